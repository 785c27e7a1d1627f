"""Checkpoint loading: GGUF and HF folders agree with transformers; bad files get clear errors."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from pagedllm.models.build import build_model
from pagedllm.weights import ModelLoadError, default_model_path, load_checkpoint
from pagedllm.weights.permute import unpermute_rows
from paged_helpers import run_paged
from tiny_models import _permute, tiny_hf_model, write_gguf, write_hf_folder

PROMPT = [5, 17, 99, 3, 250, 42, 42, 7, 1, 200, 13, 64, 128, 31]


def our_logits(path, tokens=PROMPT):
    checkpoint = load_checkpoint(path)
    model = build_model(checkpoint.config, checkpoint.weights)
    return run_paged(model, [tokens])[0]


def hf_logits(model, tokens=PROMPT):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", True)])
def test_hf_folder_logits_match_transformers(tmp_path, arch, tie):
    model = tiny_hf_model(arch, tie=tie, seed=1)
    folder = write_hf_folder(model, tmp_path)
    ours = our_logits(folder)
    assert torch.allclose(ours, hf_logits(model), atol=1e-4, rtol=0)
    assert load_checkpoint(folder).config.tie_word_embeddings == tie


def test_gguf_logits_match_transformers_on_same_file(tiny_llama, tiny_llama_gguf):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(tiny_llama_gguf)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    ours = our_logits(tiny_llama_gguf)
    assert torch.allclose(ours, hf_logits(reference), atol=1e-4, rtol=0)
    # F32 GGUF holds the HF weights exactly, so the original model agrees too.
    assert torch.allclose(ours, hf_logits(tiny_llama), atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_gguf_types_load_close_to_float(tmp_path, qtype):
    model = tiny_hf_model("llama", seed=2)
    path = write_gguf(model, tmp_path / "q.gguf", qtype)
    checkpoint = load_checkpoint(path)
    reference = model.state_dict()
    for name, tensor in checkpoint.weights.items():
        expected = reference["model." + name].float()
        scale = expected.abs().max().item()
        assert (tensor - expected).abs().max().item() <= 0.15 * scale, name
    # Quantized matrices stay as the file holds them; 4-bit ones read as codes + (d, m) stand
    # for exactly the weights the gguf library dequantizes (q/k rows unpermuted alike), 8-bit
    # ones (Q8_0 exactly, the rest rounded to it) within half a Q8_0 step.
    assert bool(checkpoint.quantized) == (qtype not in ("F16", "BF16"))
    for name, original in checkpoint.quantized.items():
        dense = checkpoint.weights[name]
        assert original.four_bit == qtype.startswith("Q4"), name
        if original.four_bit:
            assert torch.equal(original.q4().dequantize(), dense), name
        q8 = original.q8()
        step = q8.scales.repeat_interleave(32, dim=1)
        error = (q8.rows(torch.arange(dense.shape[0])) - dense).abs()
        assert (error <= step / 2 + 1e-6).all() and (qtype != "Q8_0" or error.max() == 0), name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_codes_stand_for_exactly_the_files_weights(tmp_path, qtype):
    """Q4_K and Q6_K read as their own codes and two-level scales (what the 4- and 6-bit
    kernels pack) dequantize to exactly what the gguf library gives, q/k rows unpermuted."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    from pagedllm.weights.q4 import Q4KWeight

    torch.manual_seed(2)
    model = HFLlama(LlamaConfig(vocab_size=260, hidden_size=256, intermediate_size=512,
                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=512, tie_word_embeddings=True)).eval()
    checkpoint = load_checkpoint(write_gguf(model, tmp_path / "k.gguf", qtype))
    assert checkpoint.quantized
    for name, original in checkpoint.quantized.items():
        weight = original.q4() if qtype == "Q4_K" else original.q6()
        assert isinstance(weight, Q4KWeight) == (qtype == "Q4_K")
        assert original.six_bit == (qtype == "Q6_K")
        assert torch.equal(weight.dequantize(), checkpoint.weights[name]), name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_k_quant_gguf_logits_match_transformers(tmp_path, qtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM as HFLlama

    torch.manual_seed(3)
    # k-quant rows hold 256-value blocks: a tiny model with 256-wide matrices.
    model = HFLlama(LlamaConfig(vocab_size=260, hidden_size=256, intermediate_size=256,
                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=512, tie_word_embeddings=True)).eval()
    path = write_gguf(model, tmp_path / "k.gguf", qtype)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="k.gguf", dtype=torch.float32)
    ours, theirs = our_logits(path), hf_logits(reference)
    # Logits of this random model reach ~400; float32 sums of such terms differ by ~1e-4
    # absolute with the summation order, which depends on torch's own CPU kernels (its AVX2
    # and AVX-512 ones differ), so the absolute part of the tolerance follows their scale.
    scale = theirs.abs().max().item()
    print(f"{qtype}: max |difference| {(ours - theirs).abs().max().item():.2e} at scale {scale:.0f}")
    assert torch.allclose(ours, theirs, atol=1e-6 * scale, rtol=1e-4)


def test_unpermute_inverts_llama_cpp_permutation():
    weights = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rows(_permute(weights, 8), 8), weights)


def test_default_model_is_found_and_loads():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    checkpoint = load_checkpoint(None)
    assert checkpoint.config.architecture == "llama"
    assert checkpoint.config.num_layers == 30
    assert checkpoint.config.num_kv_heads == 3
    assert checkpoint.weights["embed_tokens.weight"].shape == (49152, 576)
    # Its Q8_0 embedding is also kept 8-bit; rows read back equal the float32 ones exactly.
    q8 = checkpoint.quantized["embed_tokens.weight"].q8()
    assert q8.codes.dtype == torch.int8 and q8.codes.shape == (49152, 576)
    index = torch.tensor([[0, 1, 49151], [17, 17, 3000]])
    assert torch.equal(q8.rows(index), checkpoint.weights["embed_tokens.weight"][index])
    # Its 4-bit projections as codes + (d, m) equal the float32 weights exactly, too.
    q4 = checkpoint.quantized["layers.0.self_attn.q_proj.weight"].q4()
    assert torch.equal(q4.dequantize(), checkpoint.weights["layers.0.self_attn.q_proj.weight"])


# -- bad input -----------------------------------------------------------------------------

def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf.*no such file"):
        load_checkpoint(str(missing))


def test_truncated_gguf_is_reported(tiny_llama_gguf, tmp_path):
    data = open(tiny_llama_gguf, "rb").read()
    for cut in (100, len(data) // 2, len(data) - 64):
        broken = tmp_path / f"cut{cut}.gguf"
        broken.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf") as info:
            load_checkpoint(str(broken))
        assert "truncated" in str(info.value) or "not a readable GGUF" in str(info.value)


def test_not_a_gguf_file(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"hello, this is not a model" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf.*not a readable GGUF"):
        load_checkpoint(str(junk))


def test_unknown_gguf_architecture(tmp_path, tiny_llama):
    path = write_gguf(tiny_llama, tmp_path / "gpt.gguf", arch="llama")
    import gguf
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["general.architecture"]
    field.parts[field.data[0]][:] = np.frombuffer(b"falcn", dtype=np.uint8)
    del reader
    with pytest.raises(ModelLoadError, match="gpt.gguf.*unknown architecture 'falcn'"):
        load_checkpoint(path)


def test_unsupported_tensor_type(tmp_path, tiny_llama):
    import gguf
    path = write_gguf(tiny_llama, tmp_path / "q2.gguf")
    name = gguf.GGUFReader(path).tensors[1].name
    data = bytearray(open(path, "rb").read())
    # Relabel one tensor as IQ2_XXS in its header entry: name (u64 length + bytes),
    # n_dims (u32), dims (u64 each), type (u32).
    needle = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(needle) + len(needle)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = int(gguf.GGMLQuantizationType.IQ2_XXS).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    with pytest.raises(ModelLoadError, match="q2.gguf") as info:
        load_checkpoint(path)
    assert "IQ2_XXS" in str(info.value) or "not a readable GGUF" in str(info.value)


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(str(tmp_path))


def test_folder_with_unknown_architecture(tmp_path, tiny_llama_folder):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="config.json.*unknown architecture 'gpt_neox'"):
        load_checkpoint(str(folder))


def test_folder_with_corrupt_safetensors(tmp_path, tiny_llama_folder):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama_folder, folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="model.safetensors.*not a readable safetensors"):
        load_checkpoint(str(folder))
