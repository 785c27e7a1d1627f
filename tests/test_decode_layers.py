"""The C++ decoder-layer loop for decode steps (kernels/decode_layers.h via DecodeLoop):
bit-identical to the Python layers, taken only where it applies."""
import pytest
import torch

from paged_helpers import make_kv_caches, run_paged
from pagedllm.attention import AttentionMetadata
from pagedllm.models.decode_loop import DecodeLoop
from pagedllm.kernels import capabilities, kernel_ops
from pagedllm.models.build import EXACT_EDGE_LAYERS, decode_loop_for
from pagedllm.models.quant_linear import ALL_ROWS, q4_exact_max_rows


@pytest.fixture(scope="module")
def fast_model(isa):
    """The default model in bfloat16 on each CPU level's kernels: the C++ loop at every one
    (without the AMX tiles, which keep every step below 128 rows exact: test_amx.py)."""
    from conftest import amx_off, isa_level
    from pagedllm import LLM

    with isa_level(isa), amx_off():
        # int8-rounded prefill asked for: the default model is small enough to be exact.
        model = LLM(dtype="bfloat16", exact_activations=False,
                    kv_cache_memory=64 << 20).engine.runner.model
    assert model.decode_loop is not None, "every kernel level runs the C++ decode loop"
    assert model.decode_loop.ops.isa() == isa
    return model


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_decode_loop_is_bit_identical_to_the_python_layers(fast_model, monkeypatch, kv_cache_dtype):
    # Twelve sequences: steps above q4_exact_max_rows(level, vendor) rows round activations to
    # int8 in the middle layers, then fewer than that run exact. With an int8 cache the loop passes the
    # scales too.
    # The longest (20 tokens) crosses into a second block and decodes alone at the end.
    seqs = [[1, 504, 3300, 28, 253, 1135, 30, 216], [9690, 17, 2],
            list(range(100, 120)), [4, 5, 6, 7, 8, 9]] + [[200 + i] * (3 + i) for i in range(8)]
    calls = []
    original = DecodeLoop.__call__

    def counted(self, *args):
        calls.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(DecodeLoop, "__call__", counted)
    # One token per sequence per step: every step is decode-only, batches of 4 shrinking to 1.
    fast = run_paged(fast_model, seqs, block_size=16, chunk=1, kv_cache_dtype=kv_cache_dtype)
    assert len(calls) == max(map(len, seqs)) and set(calls) >= {1, 2, 12}
    monkeypatch.setattr(fast_model, "decode_loop", None)
    slow = run_paged(fast_model, seqs, block_size=16, chunk=1, kv_cache_dtype=kv_cache_dtype)
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)


def test_decode_loop_applies_to_decode_only_steps(fast_model):
    loop = fast_model.decode_loop
    layers = fast_model.config.num_layers
    assert len(loop.weights) == 6 * layers
    edge = [ALL_ROWS] * EXACT_EDGE_LAYERS
    assert loop.max_rows == ALL_ROWS
    middle = q4_exact_max_rows(loop.ops.isa(), capabilities().vendor)
    assert loop.exact_max_rows == edge + [middle] * (layers - 2 * EXACT_EDGE_LAYERS) + edge
    decode = AttentionMetadata.build([5, 40], [0, 1, 2], [6, 9], [[0], [2]], 16)
    mixed = AttentionMetadata.build([5, 40, 41], [0, 1, 3], [6, 10], [[0], [2]], 16)
    assert loop.applies(decode, 2)
    assert not loop.applies(mixed, 3)  # a prefill chunk rides along: the Python layers
    many = AttentionMetadata.build(list(range(129)), list(range(130)), [1] * 129,
                                   [[i // 16] for i in range(129)], 16)
    assert loop.applies(many, 129)  # 4-bit codes at any batch size


def test_decode_loop_is_built_only_on_the_fast_path(tiny_llama_gguf):
    from pagedllm import LLM

    exact = LLM(dtype="float32", kv_cache_memory=8 << 20).engine.runner.model
    assert exact.decode_loop is None and decode_loop_for(exact, kernel_ops()) is None
    # The tiny test model is float32-only GGUF (no 4-bit projections): no loop either.
    tiny = LLM(model=str(tiny_llama_gguf), dtype="bfloat16", kv_cache_memory=8 << 20).engine.runner.model
    assert tiny.decode_loop is None


def test_decode_layers_rejects_mismatched_arguments(fast_model):
    loop = fast_model.decode_loop
    config = fast_model.config
    kv = make_kv_caches(config, 4, 16, torch.bfloat16)
    hidden = torch.zeros(1, config.hidden_size, dtype=torch.bfloat16)
    args = (torch.tensor([0]), loop.cos, loop.sin)
    no_lora = ([], [], None, None)
    tail = (torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]),
            loop.num_heads, loop.eps, loop.scale, loop.exact_max_rows, loop.amx_min_rows,
            loop.int16_max_rows, *no_lora)
    keys, values = [c.key for c in kv], [c.value for c in kv]
    with pytest.raises(RuntimeError, match="6 weights and a key and value cache per layer"):
        loop.ops.decode_layers(hidden, *args, loop.weights[:-1], keys, values, [], [], *tail)
    with pytest.raises(RuntimeError, match="a row limit per layer"):
        loop.ops.decode_layers(hidden, *args, loop.weights, keys, values, [], [], *tail[:-7],
                               loop.exact_max_rows[:-1], loop.amx_min_rows, loop.int16_max_rows,
                               *no_lora)
    with pytest.raises(RuntimeError, match="one decode token per sequence"):
        loop.ops.decode_layers(hidden.expand(2, -1), *args, loop.weights, keys, values, [], [], *tail)
    int8 = make_kv_caches(config, 4, 16, torch.bfloat16, "int8")
    with pytest.raises(RuntimeError, match="scales per layer for int8 caches"):
        loop.ops.decode_layers(hidden, *args, loop.weights, [c.key for c in int8], [c.value for c in int8],
                               [c.key_scale for c in int8][:-1], [c.value_scale for c in int8], *tail)
    with pytest.raises(RuntimeError, match="needs key and value scales"):
        loop.ops.decode_layers(hidden, *args, loop.weights, [c.key for c in int8], [c.value for c in int8],
                               [], [], *tail)
    with pytest.raises(RuntimeError, match="LoRA needs A and B for 4 projections a layer"):
        loop.ops.decode_layers(hidden, *args, loop.weights, keys, values, [], [], *tail[:-4],
                               [torch.zeros(1)], [[0]], None, None)


def test_exact_activations_option_keeps_every_layer_exact(fast_model, isa):
    """--exact-activations: no layer rounds activations to int8, the C++ loop included;
    without it, the middle layers do above q4_exact_max_rows(level, vendor) rows."""
    from pagedllm import LLM
    from pagedllm.cli import build_parser, engine_config
    from pagedllm.models.quant_linear import QuantLinear
    from pagedllm.tools.text_prompts import make_prompt_token_ids

    assert engine_config(build_parser().parse_args(["serve", "--exact-activations"])).exact_activations
    assert not engine_config(build_parser().parse_args(["serve"])).exact_activations
    from conftest import amx_off, isa_level

    with isa_level(isa), amx_off():
        exact_llm = LLM(dtype="bfloat16", exact_activations=True, kv_cache_memory=16 << 20)
    exact = exact_llm.engine.runner.model
    linears = [m for m in exact.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.exact_max_rows == ALL_ROWS and m.dense is None for m in linears)
    assert exact.decode_loop.exact_max_rows == [ALL_ROWS] * exact.config.num_layers
    default = {m.exact_max_rows for m in fast_model.modules() if isinstance(m, QuantLinear)}
    assert default == {ALL_ROWS, q4_exact_max_rows(isa, capabilities().vendor)}
    # The same prompt prefilled both ways: close, not equal (the int8 rounding is in use).
    ids = make_prompt_token_ids(exact_llm.tokenizer, [64], seed=3)[0]
    exact_logits, = run_paged(exact, [ids], block_size=16)
    fast_logits, = run_paged(fast_model, [ids], block_size=16)
    assert not torch.equal(exact_logits, fast_logits)
    assert (exact_logits.argmax(-1) == fast_logits.argmax(-1)).float().mean() >= 0.9


def test_small_models_keep_exact_activations_unless_asked(fast_model):
    """The default decides by the model's size (config.exact_activations_for): the default
    model (135M) is exact, a 1.7B shape rounds prefill to int8; either flag overrides."""
    import dataclasses

    from pagedllm import LLM
    from pagedllm.cli import build_parser, engine_config
    from pagedllm.config import EngineConfig, exact_activations_for
    from pagedllm.model_config import num_parameters

    small = LLM(dtype="bfloat16", kv_cache_memory=16 << 20).engine
    assert num_parameters(small.model_config) == 134_479_872  # SmolLM2-135M, as published
    assert small.runner.model.decode_loop.exact_max_rows == [ALL_ROWS] * small.model_config.num_layers
    large = dataclasses.replace(small.model_config, hidden_size=2048, intermediate_size=8192,
                                num_layers=24, num_heads=32, num_kv_heads=32, head_dim=64)
    assert num_parameters(large) > 1_000_000_000
    assert exact_activations_for(EngineConfig(), small.model_config) is True
    assert exact_activations_for(EngineConfig(), large) is False
    assert exact_activations_for(EngineConfig(exact_activations=True), large) is True
    assert exact_activations_for(EngineConfig(exact_activations=False), small.model_config) is False
    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).exact_activations is None
    assert engine_config(parse(["serve", "--int8-activations"])).exact_activations is False
    with pytest.raises(ValueError, match="contradict"):
        engine_config(parse(["serve", "--exact-activations", "--int8-activations"]))
