"""What every command shares: the help formatter (every option shows its default), the one
parser for byte sizes, and the engine options of serve / chat / generate."""
from __future__ import annotations

import argparse
import os

from pagedllm.config import (DEFAULT_BLOCK_SIZE, DEFAULT_DTYPE, DEFAULT_MAX_NUM_BATCHED_TOKENS,
                             DEFAULT_PREFILL_ALONE_TOKENS,
                             GPU_MAX_NUM_BATCHED_TOKENS,
                             DEVICES, KV_CACHE_DTYPES, MODEL_DTYPES, SPECULATIVE_METHODS,
                             EngineConfig, LoRAConfig, SpeculativeConfig)
from pagedllm.units import parse_bytes


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows `(default: X)` after every option's help, keeps descriptions' line breaks."""

    def _get_help_string(self, action):
        # argparse would print "(default: None)" or a flag's "(default: False)": the help says
        # what None means; a flag is off unless given. (Identity, not ==: a default of 0 is
        # shown.)
        default = action.default
        if default is None or default is False or default == "" or default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def size(text: str) -> int:
    """An argparse type: a byte count written `4096`, `64MiB`, `8GiB`, `2GB` or `1e9`."""
    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write bytes (4096) or a number and a unit (512MiB, 8GiB, "
            f"2GB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value


def memory_amount(text: str) -> int | float:
    """A size (see `size`), or a bare number in (0, 1]: that fraction of available memory."""
    try:
        fraction = float(text)
    except ValueError:
        return size(text)
    if 0 < fraction <= 1:
        return fraction
    return size(text)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


class LoRAModule(str):
    """One --lora entry, "NAME=PATH", and the base model it names (vLLM's JSON form's
    base_model_name; None: the served model), which serve checks once the model is known."""

    base_model_name: str | None = None


def lora_modules(text: str) -> list[LoRAModule]:
    """An argparse type: NAME=PATH (a bare PATH is named by its file or folder), several
    separated by commas (as a config file's list arrives), or vLLM's JSON form
    {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        return [_json_lora_module(text)]
    entries = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, path = entry.rpartition("=") if "=" in entry else ("", "", entry)
        if "=" not in entry and "/" not in entry and not os.path.exists(path):
            # a word alone, naming nothing here, is a NAME whose =PATH was forgotten
            raise argparse.ArgumentTypeError(f"{entry!r} is no file or folder here: write "
                                             f"NAME=PATH (a PEFT folder or a GGUF LoRA file)")
        if not name:
            name = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
        if not name or not path:
            raise argparse.ArgumentTypeError(f"{entry!r}: write NAME=PATH (a PEFT folder or a "
                                             f"GGUF LoRA file)")
        entries.append(LoRAModule(f"{name}={path}"))
    return entries


def _json_lora_module(text: str) -> LoRAModule:
    import json

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): vLLM's form is "
                                         f'{{"name": ..., "path": ...}}') from None
    unknown = set(fields) - {"name", "path", "base_model_name"} if isinstance(fields, dict) \
        else set()
    if not isinstance(fields, dict) or unknown or not all(
            isinstance(fields.get(key), str) and fields[key] for key in ("name", "path")):
        extra = f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""
        raise argparse.ArgumentTypeError(
            f"{text!r}: vLLM's form is {{\"name\": NAME, \"path\": PATH, \"base_model_name\": "
            f"MODEL}} (base_model_name optional){extra}")
    module = LoRAModule(f"{fields['name']}={fields['path']}")
    base = fields.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"{text!r}: base_model_name must be a string")
    module.base_model_name = base
    return module


def add_lora_args(group) -> None:
    group.add_argument("--lora", "--lora-modules", dest="lora", type=lora_modules,
                       action="extend", default=None, metavar="NAME=PATH",
                       help="serve a LoRA adapter (a PEFT folder or a GGUF LoRA file) over the "
                            "model; requests pick it by `model`: NAME (repeat the option, or "
                            "separate with commas, for several; default: none, the model alone)")
    group.add_argument("--enable-lora", action="store_true",
                       help="adapter slots even without --lora, for adapters loaded while the "
                            "server runs (POST /v1/load_lora_adapter); on with --lora")
    group.add_argument("--max-loras", type=positive_int, default=4,
                       help="adapters one step can mix (their slots); a request for another "
                            "adapter waits until a slot is idle")
    group.add_argument("--max-lora-rank", type=positive_int, default=16,
                       help="the slots' rank: an adapter of a higher rank is refused")


def add_engine_args(parser: argparse.ArgumentParser, title: str = "model and engine") -> None:
    group = parser.add_argument_group(title)
    _add_model_args(group)
    _add_batch_args(group)
    _add_speculative_args(group)
    _add_device_args(group)
    group.add_argument("--threads", type=positive_int, default=None,
                       help="compute threads (default: every core; on a machine shared with "
                            "other work give fewer)")
    add_lora_args(group)


def _add_model_args(group) -> None:
    """The model and the precision it runs in."""
    group.add_argument("--model", default=None,
                       help="GGUF file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default=DEFAULT_DTYPE, choices=MODEL_DTYPES,
                       help="bfloat16: fast, 4-bit weights kept 4-bit; float32: exact")
    group.add_argument("--exact-activations", action="store_true",
                       help="bfloat16: never round activations to int8 for the 4-bit GEMMs "
                            "(prefill 1.2-2.2x slower by host, logits closer to float32; "
                            "BENCHMARKS.md); default: exact for models under 1B parameters, "
                            "prefill rounded to int8 (as llama.cpp does) from 1B on")
    group.add_argument("--int8-activations", action="store_true",
                       help="bfloat16: round prefill's activations to int8 whatever the model's "
                            "size (faster prefill, the answers of BENCHMARKS.md's quality gate); "
                            "default: only from 1B parameters")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="auto: K/V in the model's dtype; int8: codes with a scale per row, "
                            "~half the memory and decode-attention reads (BENCHMARKS.md)")


def _add_batch_args(group) -> None:
    """The KV cache and the batch: how many requests, how long, how many tokens a step."""
    group.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                       help="tokens per KV-cache block")
    group.add_argument("--max-num-seqs", default="auto",
                       help="requests running in parallel, or 'auto' (as many ~1,024-token "
                            "requests as the KV cache holds, at most 64; 256 on a GPU)")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                       help="tokens one step computes (long prompts are prefilled in chunks); "
                            f"default {DEFAULT_MAX_NUM_BATCHED_TOKENS} on a CPU "
                            f"({DEFAULT_PREFILL_ALONE_TOKENS} in a step where no request "
                            f"decodes), {GPU_MAX_NUM_BATCHED_TOKENS} on a GPU")
    group.add_argument("--kv-cache-memory", type=memory_amount, default=None,
                       help="KV-cache size: bytes (64MiB, 2GiB) or a fraction (0-1] of available "
                            "memory (default: room for 4 requests at the model's full context, "
                            "within half of available memory, at least min(a tenth, 512 MiB))")
    group.add_argument("--max-model-len", type=positive_int, default=None,
                       help="longest prompt + answer in tokens (default: the model's context, "
                            "capped by the KV cache)")
    group.add_argument("--no-prefix-caching", action="store_true",
                       help="never reuse cached prompt blocks between requests")
    group.add_argument("--max-memory", type=size, default=None,
                       help="resident size past which new requests wait, running ones go on "
                            "(default: wait while the machine has under 10%% of its memory free)")


def _add_speculative_args(group) -> None:
    group.add_argument("--speculative", default="off", choices=SPECULATIVE_METHODS,
                       help="ngram: propose tokens copied from the prompt and answer so far; "
                            "draft: proposed by --draft-model; either way several tokens are "
                            "verified per step (same output, faster when proposals are "
                            "accepted; BENCHMARKS.md); a request may choose with its "
                            "`speculative` field (default: off)")
    group.add_argument("--num-speculative-tokens", type=positive_int, default=5,
                       help="most tokens proposed per step with --speculative (1-16, default 5)")
    group.add_argument("--draft-model", default=None,
                       help="with --speculative draft: a smaller GGUF file or Hugging Face folder "
                            "of the same tokenizer that proposes the tokens (default: none)")


def _add_device_args(group) -> None:
    """Where the model runs, and what only a GPU does."""
    group.add_argument("--device", default="auto", choices=DEVICES,
                       help="where the model runs: cpu (the C++ kernels), cuda (the GPU: "
                            "weights dense in --dtype; refused, with why, where no GPU is "
                            "usable), auto (the GPU where torch sees one, else the CPU)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="with --device cuda: the share of the GPU's memory this server may "
                            "hold; the KV cache gets what the weights leave of it (vLLM's "
                            "option; --kv-cache-memory sets the cache's size instead)")
    group.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                       help="capture decode steps as CUDA graphs, one per batch size up to "
                            "--max-num-seqs, and replay them (vLLM's way to take Python off "
                            "the step); default: on a GPU, off on a CPU")
    group.add_argument("--gpu-4bit-weights", action="store_true",
                       help="with --device cuda: a GGUF's 4-bit projections stay 4-bit on the "
                            "GPU (a Triton kernel unpacks them for decode steps) instead of "
                            "dense in --dtype; new, not yet measured on a GPU (default: off)")
    group.add_argument("--gpu-fp8-weights", action="store_true",
                       help="with --device cuda on an Ada or Hopper card and --dtype bfloat16: "
                            "the projections as float8 (e4m3) with a scale a row, activations "
                            "rounded per token (vLLM's --quantization fp8); half the weight "
                            "bytes; new, not yet measured on a GPU (default: off)")
    group.add_argument("--enforce-eager", dest="cuda_graphs", action="store_false",
                       default=None, help="no CUDA graphs (vLLM's option; --no-cuda-graphs; default: "
                            "graphs on a GPU)")
    group.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=None,
                       help="plan and launch each step before the one in flight is applied, "
                            "so a GPU never waits for the host (same tokens); default: on a "
                            "GPU, off on a CPU, where it gains nothing")
    group.add_argument("--async-scheduling", dest="overlap_steps", action="store_true",
                       default=None, help="--overlap-steps (vLLM's option; default: on a GPU, off on a CPU)")


def engine_config(args) -> EngineConfig:
    """The command line's engine settings as the one EngineConfig; raises ValueError for a
    bad value. Sets torch's thread count when --threads is given."""
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    max_num_seqs = args.max_num_seqs
    if max_num_seqs != "auto":
        try:
            max_num_seqs = int(max_num_seqs)
        except ValueError:
            raise ValueError(f"max_num_seqs must be 'auto' or positive, got {max_num_seqs!r}") from None
    if args.exact_activations and args.int8_activations:
        raise ValueError("--exact-activations and --int8-activations contradict each other")
    exact = True if args.exact_activations else False if args.int8_activations else None
    return EngineConfig(model=args.model, dtype=args.dtype, exact_activations=exact,
                        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, max_num_seqs=max_num_seqs,
                        max_model_len=args.max_model_len, max_memory=args.max_memory,
                        enable_prefix_caching=not args.no_prefix_caching,
                        max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        cuda_graphs=args.cuda_graphs, gpu_4bit_weights=args.gpu_4bit_weights,
                        gpu_fp8_weights=args.gpu_fp8_weights,
                        overlap_steps=args.overlap_steps,
                        speculative=SpeculativeConfig(
                            method=args.speculative,
                            num_speculative_tokens=args.num_speculative_tokens,
                            draft_model=args.draft_model),
                        lora=lora_config(args))


def lora_config(args) -> LoRAConfig:
    """The command line's LoRA options (add_lora_args) as serve's LoRAConfig."""
    return LoRAConfig(tuple(tuple(entry.rsplit("=", 1)) for entry in args.lora or ()),
                      args.enable_lora, args.max_loras, args.max_lora_rank)
