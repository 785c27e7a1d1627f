"""LoRA on the tiny models: adapter files read as peft means them (rank, alpha, rsLoRA,
rank_pattern / alpha_pattern), the same weights from a GGUF as from a PEFT folder, the model's
logits with several adapters and the base in one batch against transformers + peft, the
grouped product against its per-token reference, and every refusal in one clear line."""
from gpu_path import ON  # (switches Triton's interpreter on, off a GPU: before Triton)

import copy  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from lora_adapters import write_gguf_adapter  # noqa: E402
from paged_helpers import run_paged  # noqa: E402
from pagedllm.config import LoRAConfig  # noqa: E402
from pagedllm.lora import AdapterError, load_adapter  # noqa: E402
from pagedllm.lora.grouped import MAX_PADDING_RATIO, LoRABatch, add_lora, add_lora_reference  # noqa: E402
from pagedllm.lora.slots import LoRASlots  # noqa: E402
from pagedllm.models.build import build_model  # noqa: E402
from pagedllm.weights import load_checkpoint  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft(tiny_llama, folder, seed=1, **settings):
    """A peft LoRA over a copy of the tiny model with random (non-zero) A and B, saved as a
    PEFT folder: (the PeftModel, its folder)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS,
                           "init_lora_weights": False, **settings})
    model = get_peft_model(copy.deepcopy(tiny_llama), config).eval()
    with torch.no_grad():  # peft's random init is tiny next to the widened base weights
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    return model, str(folder)


@pytest.fixture(scope="module")
def tiny(tiny_llama_folder):
    checkpoint = load_checkpoint(tiny_llama_folder)
    return checkpoint.config, build_model(checkpoint.config, checkpoint.weights)


def logits_with(model, config, adapters, seqs, slots_of, scales=None, max_rank=8):
    """The model's logits for seqs in one batch, seq i with adapter slots_of[i] (-1: base)."""
    lora = LoRASlots(model, config, LoRAConfig(max_loras=max(len(adapters), 1),
                                                max_lora_rank=max_rank), torch.float32)
    model.lora = lora
    try:
        for slot, adapter in enumerate(adapters):
            lora.load(slot, adapter)
        scales = scales or [1.0] * len(seqs)
        lora.set_batch([s for seq, s in zip(seqs, slots_of) for _ in seq],
                       [c for seq, c in zip(seqs, scales) for _ in seq])
        return run_paged(model, seqs)
    finally:
        _unwrap(model)


def _unwrap(model):
    from pagedllm.lora.slots import LoRAProjection

    for layer in model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name, module in list(owner.named_children()):
                if isinstance(module, LoRAProjection):
                    setattr(owner, name, module.base)
    model.lora = None


def hf_logits(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


SEQS = [[5, 9, 33, 71, 2, 200, 14], [7, 7, 100, 3], [250, 1, 60, 61, 62]]


def test_several_adapters_and_the_base_in_one_batch_match_peft(tiny, tiny_llama, tmp_path):
    config, model = tiny
    peft_a, path_a = make_peft(tiny_llama, tmp_path / "a", seed=1)
    peft_b, path_b = make_peft(tiny_llama, tmp_path / "b", seed=2, r=2, lora_alpha=3,
                               target_modules=["q_proj", "v_proj", "down_proj"])
    adapters = [load_adapter("a", path_a, config), load_adapter("b", path_b, config)]
    ours = logits_with(model, config, adapters, SEQS, [0, -1, 1])
    for got, reference in zip(ours, [hf_logits(peft_a, SEQS[0]), hf_logits(tiny_llama, SEQS[1]),
                                     hf_logits(peft_b, SEQS[2])]):
        torch.testing.assert_close(got, reference, atol=2e-4, rtol=1e-4)
    # and the adapter changes the answer: it is not silently the base
    assert (ours[0] - hf_logits(tiny_llama, SEQS[0])).abs().max() > 0.1


@pytest.mark.parametrize("settings", [
    {"use_rslora": True},
    {"rank_pattern": {"q_proj": 2, "down_proj": 6}, "alpha_pattern": {"v_proj": 3}},
])
def test_rslora_and_per_module_ranks_and_alphas_match_peft(tiny, tiny_llama, tmp_path, settings):
    config, model = tiny
    reference, path = make_peft(tiny_llama, tmp_path / "p", **settings)
    adapter = load_adapter("p", path, config)
    ours = logits_with(model, config, [adapter], [SEQS[0]], [0])[0]
    torch.testing.assert_close(ours, hf_logits(reference, SEQS[0]), atol=2e-4, rtol=1e-4)


def test_a_requests_scale_weighs_its_adapter(tiny, tiny_llama, tmp_path):
    config, model = tiny
    _, path = make_peft(tiny_llama, tmp_path / "a")
    adapter = load_adapter("a", path, config)
    zero, half, full = logits_with(model, config, [adapter], [SEQS[0]] * 3, [0, 0, 0],
                                   scales=[0.0, 0.5, 1.0])
    torch.testing.assert_close(zero, hf_logits(tiny_llama, SEQS[0]), atol=2e-4, rtol=1e-4)
    assert not torch.allclose(half, full, atol=1e-3) and not torch.allclose(half, zero, atol=1e-3)


def test_a_gguf_adapter_holds_the_same_weights_as_its_peft_folder(tiny_llama, tiny_llama_gguf,
                                                                  tiny_llama_folder, tmp_path):
    _, path = make_peft(tiny_llama, tmp_path / "a")
    cfg = tiny_llama.config
    gguf_path = write_gguf_adapter(path, tmp_path / "a.gguf", cfg.num_attention_heads,
                                   cfg.num_key_value_heads)
    from_gguf = load_adapter("a", gguf_path, load_checkpoint(tiny_llama_gguf).config)
    from_peft = load_adapter("a", path, load_checkpoint(tiny_llama_folder).config)
    assert from_gguf.source == "gguf" and from_peft.source == "peft"
    assert from_gguf.modules.keys() == from_peft.modules.keys()
    for key, weights in from_peft.modules.items():
        for got, expected in zip(from_gguf.modules[key].parts, weights.parts):
            torch.testing.assert_close(got, expected)
    assert from_gguf.key == from_peft.key  # same weights: the same cache key


def test_a_gguf_adapter_on_the_gguf_model_matches_peft(tiny_llama, tiny_llama_gguf, tmp_path):
    reference, path = make_peft(tiny_llama, tmp_path / "a")
    cfg = tiny_llama.config
    gguf_path = write_gguf_adapter(path, tmp_path / "a.gguf", cfg.num_attention_heads,
                                   cfg.num_key_value_heads)
    checkpoint = load_checkpoint(tiny_llama_gguf)
    model = build_model(checkpoint.config, checkpoint.weights)
    adapter = load_adapter("a", gguf_path, checkpoint.config)
    ours = logits_with(model, checkpoint.config, [adapter], [SEQS[0]], [0])[0]
    torch.testing.assert_close(ours, hf_logits(reference, SEQS[0]), atol=2e-4, rtol=1e-4)


# -- the grouped product --------------------------------------------------------------------
def stacks(dtype, num_slots=4, rank=6, fan_in=24, part_starts=(0, 16, 24, 32), seed=0):
    generator = torch.Generator().manual_seed(seed)
    parts = len(part_starts) - 1
    a = (torch.randn(num_slots, parts * rank, fan_in, generator=generator) * 0.3).to(dtype)
    b = (torch.randn(num_slots, rank, part_starts[-1], generator=generator) * 0.3).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_slots", [
    [0, 1, 2, 1, 0, -1, 3, 3],  # decode-like: every slot a token or two, and the base
    [2] * 40 + [0, 1, -1],  # one long prompt beside single tokens: ungrouped
    [-1, 1, 1, 1, 1, 0, 0, 0, 2, 2, 2, 2],  # segments of similar length: grouped
])
@pytest.mark.parametrize("part_starts", [(0, 16, 24, 32), (0, 40)])
def test_the_grouped_product_equals_the_per_token_reference(dtype, token_slots, part_starts):
    generator = torch.Generator().manual_seed(1)
    a, b = stacks(dtype, part_starts=part_starts)
    x = torch.randn(len(token_slots), a.shape[2], generator=generator).to(dtype)
    y = torch.randn(len(token_slots), part_starts[-1], generator=generator).to(dtype)
    scales = [0.5 + 0.1 * i for i in range(len(token_slots))]
    batch = LoRABatch.build(token_slots, scales, dtype=dtype)
    used = [s for s in token_slots if s >= 0]
    assert batch.grouped == (len(set(used)) * max(used.count(s) for s in used)
                             <= MAX_PADDING_RATIO * len(used))
    got = add_lora(y.clone(), x, a, b, part_starts, batch)
    expected = add_lora_reference(y, x, a, b, part_starts, token_slots, scales)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(got, expected, **tolerance)
    base = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base], y[base])  # the base's tokens are left exactly as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 77])
def test_the_c_kernel_equals_the_per_token_reference_at_every_level(ops, dtype, tokens):
    generator = torch.Generator().manual_seed(tokens)
    part_starts = (0, 576, 768, 960)  # the default model's q/k/v, rank 16
    a, b = stacks(dtype, num_slots=3, rank=16, fan_in=576, part_starts=part_starts,
                  seed=tokens)
    token_slots = [(t % 4) - 1 for t in range(tokens)]  # the base's among them
    scales = [0.25 + 0.25 * (t % 4) for t in range(tokens)]
    x = torch.randn(tokens, 576, generator=generator).to(dtype)
    y = torch.randn(tokens, 960, generator=generator).to(dtype)
    batch = LoRABatch.build(token_slots, scales, dtype=dtype)
    expected = add_lora_reference(y, x, a, b, part_starts, token_slots, scales)
    got = add_lora(y.clone(), x, a, b, part_starts, batch, kernels=ops) if batch else y
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(got, expected, **tolerance)
    base = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base], y[base])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part_starts", [(0, 64, 80, 96), (0, 64, 128), (0, 96)])
def test_the_triton_kernels_equal_the_per_token_reference(dtype, part_starts):
    from pagedllm.lora.triton_sgmv import TritonLoRA

    generator = torch.Generator().manual_seed(3)
    tokens, fan_in = 7, 72  # not a multiple of the kernels' blocks
    a, b = stacks(dtype, num_slots=3, rank=5, fan_in=fan_in, part_starts=part_starts)
    token_slots = [0, -1, 2, 2, 1, -1, 0]
    scales = [1.0, 1.0, 0.5, 2.0, 1.0, 1.0, -1.0]
    x = torch.randn(tokens, fan_in, generator=generator).to(dtype)
    y = torch.randn(tokens, part_starts[-1], generator=generator).to(dtype)
    batch = LoRABatch.build(token_slots, scales, device=ON, dtype=dtype)
    to = lambda t: t.to(ON)  # noqa: E731
    got = add_lora(to(y.clone()), to(x), to(a), to(b), part_starts, batch,
                   kernels=TritonLoRA()).cpu()
    expected = add_lora_reference(y, x, a, b, part_starts, token_slots, scales)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(got, expected, **tolerance)
    assert torch.equal(got[[1, 5]], y[[1, 5]])


def test_the_c_kernel_refuses_mismatched_tensors(ops):
    x, y = torch.zeros(2, 8), torch.zeros(2, 4)
    a, b = torch.zeros(1, 2, 8), torch.zeros(1, 2, 4)
    slots, scales = torch.tensor([0, 5]), torch.ones(2)
    with pytest.raises(RuntimeError, match="past the stacks"):
        ops.lora_add(y, x, a, b, slots, scales, [0, 4])
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.lora_add(y, x, a.bfloat16(), b, torch.tensor([0, 0]), scales, [0, 4])
    with pytest.raises(RuntimeError, match="part_starts"):
        ops.lora_add(y, x, a, b, torch.tensor([0, 0]), scales, [0, 3])


def test_a_step_without_adapter_tokens_has_no_batch():
    assert LoRABatch.build([-1, -1], [1.0, 1.0]) is None


# -- refusals -------------------------------------------------------------------------------
def _edit_config(path, **changes):
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        settings = json.load(f)
    settings.update(changes)
    with open(file, "w") as f:
        json.dump(settings, f)


@pytest.mark.parametrize("changes, message", [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias='all'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, "IA3 adapter"),
])
def test_options_pagedllm_cannot_honour_are_refused_by_name(tiny, tiny_llama, tmp_path,
                                                            changes, message):
    _, path = make_peft(tiny_llama, tmp_path / "a")
    _edit_config(path, **changes)
    with pytest.raises(AdapterError, match=message):
        load_adapter("a", path, tiny[0])


def test_an_adapter_for_another_model_is_one_clear_line(tiny, tiny_llama, tmp_path):
    import dataclasses

    _, path = make_peft(tiny_llama, tmp_path / "a")
    other = dataclasses.replace(tiny[0], intermediate_size=96)  # another model's MLP
    with pytest.raises(AdapterError, match="made for another model") as err:
        load_adapter("a", path, other)
    assert "\n" not in str(err.value)
    fewer_layers = dataclasses.replace(tiny[0], num_layers=1)
    with pytest.raises(AdapterError, match="layer 1; the base model has 1 layers"):
        load_adapter("a", path, fewer_layers)


def test_rank_above_the_servers_limit_is_refused(tiny, tiny_llama, tmp_path):
    _, path = make_peft(tiny_llama, tmp_path / "a", r=8)
    with pytest.raises(AdapterError, match="rank 8, above this server's --max-lora-rank 4"):
        load_adapter("a", path, tiny[0], max_rank=4)


def test_corrupt_missing_and_foreign_files_are_refused(tiny, tiny_llama, tiny_llama_gguf,
                                                       tmp_path):
    config = tiny[0]
    _, path = make_peft(tiny_llama, tmp_path / "a")
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(100)
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_adapter("a", path, config)
    os.remove(weights)
    with pytest.raises(AdapterError, match="has no adapter_model.safetensors"):
        load_adapter("a", path, config)
    open(os.path.join(path, "adapter_model.bin"), "wb").close()
    with pytest.raises(AdapterError, match="pickle"):
        load_adapter("a", path, config)
    with pytest.raises(AdapterError, match="does not exist"):
        load_adapter("a", str(tmp_path / "nowhere"), config)
    with pytest.raises(AdapterError, match="not a LoRA adapter"):
        load_adapter("a", tiny_llama_gguf, config)  # a model, not an adapter
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(AdapterError, match="neither a PEFT folder"):
        load_adapter("a", str(tmp_path / "x.txt"), config)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(AdapterError, match="cannot be read"):
        load_adapter("a", path, config)


def test_weights_it_cannot_apply_or_half_pairs_are_refused(tiny, tmp_path):
    from safetensors.torch import save_file

    config = tiny[0]
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                            "lora_alpha": 2}))
    prefix = "base_model.model.model.layers.0."
    cases = [
        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64)}, "lm_head"),
        ({prefix + "self_attn.q_proj.lora_A.weight": torch.zeros(2, 64)}, "not its other half"),
        ({prefix + "self_attn.q_proj.lora_A.weight": torch.zeros(2, 64),
          prefix + "self_attn.q_proj.lora_B.weight": torch.full((64, 2), float("nan"))},
         "not finite"),
        ({"base_model.model.model.layers.9.mlp.down_proj.lora_A.weight": torch.zeros(2, 128),
          "base_model.model.model.layers.9.mlp.down_proj.lora_B.weight": torch.zeros(64, 2)},
         "layer 9"),
        ({}, "holds no LoRA weights"),
    ]
    for tensors, message in cases:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        with pytest.raises(AdapterError, match=message):
            load_adapter("a", str(folder), config)
