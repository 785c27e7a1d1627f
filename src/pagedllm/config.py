"""Frozen configuration records shared by every part of pagedllm, and every default once.

`ModelConfig` (model_config.py) describes a checkpoint (read from GGUF metadata or
config.json); `EngineConfig` is what a user asks of the engine (LLM(**kwargs) and the CLI both build it,
and it checks itself); the server's own: server/server_config.py; `CacheConfig` and `SchedulerConfig` are what the engine derives from
it once the model and the memory are known. Plain data: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.model_config import ModelConfig, num_parameters

MODEL_DTYPES = ("float32", "bfloat16")
# The command line's dtype (serve, chat, generate and plan alike, so a plan sizes the server
# that the same flags start); the offline LLM() keeps float32, exact by default.
DEFAULT_DTYPE = "bfloat16"
DEFAULT_BLOCK_SIZE = 16
# Tokens one step may compute (chunked prefill); measured: BENCHMARKS.md, "step budget".
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256
# ... and a step in which no request decodes, by default on a CPU: 256 keeps the steps of
# requests decoding meanwhile short, and without them a prompt of up to 512 tokens is
# prefilled in one step, not two (BENCHMARKS.md, "Prefill attention on the tiles").
DEFAULT_PREFILL_ALONE_TOKENS = 512
# On a GPU a step of thousands of tokens costs little more than one of a few hundred (the
# launches and the host's work per step dominate): vLLM's default of 2048.
GPU_MAX_NUM_BATCHED_TOKENS = 2048


def default_step_budget(device: str) -> int:
    """max_num_batched_tokens where it is not given: by where the model runs."""
    return GPU_MAX_NUM_BATCHED_TOKENS if device == "cuda" else DEFAULT_MAX_NUM_BATCHED_TOKENS

# max_tokens when the caller leaves it out, per entry point, all in one place. None means "up
# to the context length" (and the server's --max-tokens-limit); the engine resolves and checks
# it once (core.output_budget.resolve_max_tokens). The two API values are OpenAI's: 16 for the legacy
# completions endpoint (and SamplingParams, as vLLM), none for chat.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = None
CLI_CHAT_MAX_TOKENS = 512  # `pagedllm chat`: a full answer
CLI_GENERATE_MAX_TOKENS = 64  # `pagedllm generate`: a quick look
BENCH_MAX_TOKENS = 128  # `pagedllm bench`: long enough that decode dominates


# "auto": K/V in the model's dtype; "int8": codes with a scale per row (attention/layer_cache.py).
KV_CACHE_DTYPES = ("auto", "int8")


# Speculative decoding (core/speculation.py): proposals of n-grams from the request itself,
# or from a draft model.
SPECULATIVE_METHODS = ("off", "ngram", "draft")
DEVICES = ("auto", "cpu", "cuda")  # --device (backends/device.py)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"  # the server's default; a request may override it
    num_speculative_tokens: int = 5  # at most this many proposals a step (vLLM's name)
    prompt_lookup_max: int = 4  # the longest n-gram matched (vLLM's names)
    prompt_lookup_min: int = 2
    # Proposals stop when a step's sequences are this many or more: verification multiplies
    # the rows a step computes, and at large batches the weights are read for many rows
    # anyway, so extra rows cost about what they save (BENCHMARKS.md, "speculative").
    max_batch_sequences: int = 8
    # At most this many rows (sequences x (1 + proposals)) in a verifying step; the model
    # runner lowers it to what its fused decode path takes (engine/factory.py).
    max_rows: int = 32
    # method "draft": a smaller model of the same tokenizer proposes (engine/draft_proposer.py).
    draft_model: str | None = None

    def __post_init__(self):
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("speculative method 'draft' needs a draft model "
                             "(--speculative draft --draft-model PATH)")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be 1-16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters over the served model (lora/): those named at start, and how many may sit
    in the batch's slots at once (vLLM's --max-loras, --max-lora-rank)."""
    adapters: tuple[tuple[str, str], ...] = ()  # (name, path) pairs, --lora NAME=PATH
    enabled: bool = False  # --enable-lora: slots even without adapters (loaded at run time)
    max_loras: int = 4  # adapters resident in slots at once: a step mixes up to this many
    max_lora_rank: int = 16  # the slots' rank; a higher-rank adapter is refused

    def __post_init__(self):
        if not 1 <= self.max_loras <= 64:
            raise ValueError(f"max_loras must be 1-64, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be 1-512, got {self.max_lora_rank}")
        names = [name for name, _ in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must differ, got {names}")

    @property
    def active(self) -> bool:
        return self.enabled or bool(self.adapters)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings as asked for; checked here, before anything loads."""
    model: str | None = None  # GGUF file or Hugging Face folder; None: the default model
    dtype: str = "float32"  # one of MODEL_DTYPES
    # bfloat16: True never rounds activations to int8, False rounds them in large steps
    # (prefill), None decides by the model's size (exact_activations_for).
    exact_activations: bool | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | float | None = None  # bytes, a fraction of free memory, or default
    max_num_seqs: int | str = "auto"
    max_num_batched_tokens: int | None = None  # None: by device (default_step_budget)
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's context, capped by the KV capacity
    max_memory: int | None = None  # resident bytes past which admissions wait; None: leave
    #                                a tenth of the machine free (engine/memory_guard.py)
    speculative: SpeculativeConfig = SpeculativeConfig()  # method "off" unless asked
    device: str = "auto"  # auto, cpu or cuda (backends/device.py)
    # On a GPU: the share of the card this process may hold (weights + KV); the KV pool is
    # what is left of it once the weights are loaded (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float = 0.9
    # This engine shares its device with other models (a model store's): on a GPU its KV
    # pool is then the default amount (sizing.default_kv_memory) of what the share leaves,
    # not all of it, so that the next model finds room too.
    shares_device: bool = False
    # Decode steps captured and replayed (engine/cuda_graphs.py); None: on a GPU, as vLLM
    # (BENCHMARKS.md, "The engine on an H200"), off elsewhere.
    cuda_graphs: bool | None = None
    # On the generic backend (a GPU): a GGUF's 4-bit projections stay 4-bit on the device
    # (models/int4_triton.py) instead of dense in dtype. Off until measured on a GPU.
    gpu_4bit_weights: bool = False
    # On the generic backend: a bfloat16 model's projections as float8 (e4m3) with a scale
    # a row, activations rounded per token (models/fp8_linear.py). Off until measured on a GPU.
    gpu_fp8_weights: bool = False
    lora: LoRAConfig = LoRAConfig()  # adapters and their slots (inactive unless asked)
    # Plan and launch step t+1 while step t runs (engine/overlap.py); None: by device.
    overlap_steps: bool | None = None

    def overlaps_steps(self, device: str) -> bool:
        """Whether steps overlap on `device`: as asked, else on a GPU (BENCHMARKS.md,
        "Overlapped steps")."""
        return self.overlap_steps if self.overlap_steps is not None else device == "cuda"

    def uses_cuda_graphs(self, device: str, capturable: bool = True) -> bool:
        """Whether decode steps replay as CUDA graphs on `device`: as asked, else on a GPU.
        A model whose forward cannot be captured (capturable False: a mixture of experts
        routes its tokens on the host) runs eagerly by default, and is refused when graphs
        were asked for."""
        if self.cuda_graphs and not capturable:
            raise ValueError("--cuda-graphs: this model's mixture-of-experts layers route "
                             "tokens on the host, which a CUDA graph cannot capture; serve "
                             "it without --cuda-graphs (decode steps then run eagerly)")
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return device == "cuda" and capturable

    def step_budget(self, device: str) -> int:
        """The tokens one step computes on `device` (cpu or cuda)."""
        return self.max_num_batched_tokens or default_step_budget(device)

    def prefill_alone_budget(self, device: str) -> int:
        """The tokens a step in which no request decodes computes: more than step_budget on
        a CPU by default; a budget the user gives is the one bound of every step."""
        if self.max_num_batched_tokens is not None or device == "cuda":
            return self.step_budget(device)
        return max(DEFAULT_PREFILL_ALONE_TOKENS, self.step_budget(device))

    def __post_init__(self):
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig, got {self.speculative!r}")
        if self.max_memory is not None and (isinstance(self.max_memory, bool)
                                            or not isinstance(self.max_memory, int)
                                            or self.max_memory < 1):
            raise ValueError(f"max_memory must be a positive number of bytes, got {self.max_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs != "auto" and (isinstance(self.max_num_seqs, bool)
                                            or not isinstance(self.max_num_seqs, int)
                                            or self.max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be 'auto' or positive, got {self.max_num_seqs}")


# Models below this many parameters keep exact activations by default: their prefill is cheap
# (the 135M model's is ~6x llama.cpp's speed), and on the default model int8-rounded prefill
# flips the answer to the first question people ask (benchmarks/quality_gate.py).
EXACT_ACTIVATIONS_BELOW_PARAMS = 1_000_000_000


def exact_activations_for(config: EngineConfig, model: ModelConfig) -> bool:
    """The setting as asked, or by the model's size when not asked."""
    if config.exact_activations is not None:
        return config.exact_activations
    return num_parameters(model) < EXACT_ACTIVATIONS_BELOW_PARAMS


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 0  # 0 until sized from kv_cache_memory
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    # The budget of a step in which no running request decodes (nobody's next token waits on
    # it); None: max_num_batched_tokens.
    prefill_alone_tokens: int | None = None

    @property
    def largest_step(self) -> int:
        """The most tokens any step computes (what sizing reserves room for)."""
        return max(self.max_num_batched_tokens, self.prefill_alone_tokens or 0)
