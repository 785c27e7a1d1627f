"""The bfloat16 model's output head on the generic backend (a GPU's, here on the CPU):
the product over the vocabulary in bfloat16, each row's top candidates recomputed exactly
(models/output_head.py: DeviceHead)."""
from __future__ import annotations

from gpu_path import ON as TENSOR_DEVICE  # (first: it switches Triton's interpreter on)

import torch  # noqa: E402

from pagedllm.backends.cpu import generic_backend  # noqa: E402
from pagedllm.models.build import LOGIT_REFINE_CANDIDATES, build_model  # noqa: E402
from pagedllm.models.output_head import DeviceHead, ExactHead  # noqa: E402
from pagedllm.weights import load_checkpoint  # noqa: E402
from tiny_models import tiny_hf_model, write_hf_folder  # noqa: E402


def near_ties(rows: int = 64, vocab: int = 3000, hidden: int = 256):
    """Weights whose two best tokens for each row are a hair apart: the bfloat16 product
    alone picks the wrong one for some rows."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    x = torch.randn(rows, hidden, generator=g)
    for r in range(rows):  # token 2r and 2r+1 stand out for row r, 1e-4 apart
        direction = x[r] / x[r].norm() ** 2
        weight[2 * r] += 20 * direction
        weight[2 * r + 1] += (20 + 1e-4 * (1 if r % 2 else -1)) * direction
    return weight, x


def test_the_top_candidates_are_exact_and_the_rest_rounded():
    weight, x = near_ties()
    head, exact = DeviceHead(weight, LOGIT_REFINE_CANDIDATES), ExactHead(weight)
    got, want = head(x), exact(x)
    assert got.dtype == torch.float32 and head.rounded.dtype == torch.bfloat16
    assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))
    rounded = (x.to(torch.bfloat16) @ weight.to(torch.bfloat16).T).float()
    assert not torch.equal(rounded.argmax(dim=-1), want.argmax(dim=-1))  # why it refines
    top = want.topk(2, dim=-1).indices  # (the tail of the 16 may differ: rounded candidates)
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=0, atol=1e-4)
    assert (got - want).abs().max() < 0.1  # the rest: bfloat16's rounding
    assert (got.gather(1, top) != rounded.gather(1, top)).any()


def test_a_bfloat16_model_on_the_generic_backend_gets_it_and_a_float32_one_the_exact(tmp_path):
    checkpoint = load_checkpoint(write_hf_folder(tiny_hf_model("llama", seed=2), tmp_path))
    backend = generic_backend(TENSOR_DEVICE)
    models = {dtype: build_model(checkpoint.config, checkpoint.weights, dtype=dtype,
                                 backend=backend) for dtype in (torch.bfloat16, torch.float32)}
    head = models[torch.bfloat16].head
    assert type(head) is DeviceHead and type(models[torch.float32].head) is ExactHead
    # Tied to the embedding (the tiny llama's are): one float32 matrix, not two.
    assert head.weight is models[torch.bfloat16].embedding.weight
    hidden = torch.randn(5, checkpoint.config.hidden_size, device=TENSOR_DEVICE)
    want = ExactHead(head.weight)(hidden)
    assert torch.equal(head(hidden).argmax(dim=-1), want.argmax(dim=-1))
