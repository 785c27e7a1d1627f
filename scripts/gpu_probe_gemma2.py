"""One-off GPU probe (issue 32): gemma2's float32 logits against transformers with the
Triton attention and with torch's, to tell where the soft-capped path loses precision."""
import torch

from paged_helpers import run_paged
from pagedllm.backends.cpu import generic_backend
from pagedllm.models.build import build_model
from pagedllm.weights import load_checkpoint
from tiny_models import tiny_hf_model, write_hf_folder
import tempfile

reference = tiny_hf_model("gemma2", seed=3)
checkpoint = load_checkpoint(write_hf_folder(reference, tempfile.mkdtemp()))
seq = [7, 3, 9, 200, 15, 15, 16, 80, 81]
with torch.no_grad():
    expected = reference(torch.tensor([seq])).logits[0]
    expected_cuda = reference.to("cuda")(torch.tensor([seq], device="cuda")).logits[0].cpu()
for attention in ("triton", "batched"):
    model = build_model(checkpoint.config, checkpoint.weights,
                        backend=generic_backend("cuda", attention=attention))
    logits = run_paged(model, [seq], device="cuda")[0]
    print(attention, "vs transformers on CPU:", (logits - expected).abs().max().item(),
          "vs transformers on the GPU:", (logits - expected_cuda).abs().max().item())
print("transformers GPU vs CPU:", (expected_cuda - expected).abs().max().item())
