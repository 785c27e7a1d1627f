"""The CPU backend: this CPU's level (kernels.capabilities), its compiled C++ kernels (None
without a compiler or with PAGEDLLM_NO_KERNELS) and what this torch build offers besides
(kernels.torch_ops), probed once and carried as one record."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.backends.torch_layer_ops import TorchLayerOps
from pagedllm.kernels import Capabilities, TorchOps, capabilities, kernel_ops, torch_ops


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" (the C++ kernels at the CPU's level), "torch" (the generic path)
    device: str  # where tensors live ("cpu", "cuda")
    cpu: Capabilities
    kernels: object | None  # the compiled module of the level in use
    torch_ops: TorchOps
    # Paged attention: "batched" (the C++ kernels, or torch where they are not), "triton"
    # (attention/triton_paged.py: the GPU's; on the CPU under Triton's interpreter, tests).
    attention: str = "batched"
    # The generic path's layer ops: "torch" (torch_layer_ops.py) or "triton"
    # (triton_layer_ops.py: one launch each, the GPU's; on the CPU under the interpreter).
    generic_layer_ops: str = "torch"
    # Buffers reused from layer to layer by the AMX path (models/quant_linear.py), by shape:
    # an engine's layers run one after another, so one buffer a shape serves them all.
    scratch: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def generic(self) -> bool:
        """The generic torch path (any device): dense weights in the model dtype, torch's
        layer ops and attention over the paged cache, logits sampled on the host. The CUDA
        backend is this path on the GPU; on the CPU it is how CI tests that path."""
        return self.name == "torch"

    @property
    def prepacks_bfloat16(self) -> bool:
        """Whether dense bfloat16 weights are prepacked for oneDNN (else widened to float32:
        a level without bfloat16 arithmetic would only convert them back on every call)."""
        return (not self.generic and self.cpu.native_bf16
                and self.torch_ops.onednn_prepack)

    @property
    def prefill_sdpa(self) -> bool:
        """Whether prefill attention goes to torch's fused SDPA rather than pagedllm's tiled
        kernel: where the AMX tiles are in use, oneDNN multiplies q.k and p.v on them, ~4x
        the tiled kernel's AVX512-BF16 dot products (which Intel's cores issue at a quarter
        of the integer rate; BENCHMARKS.md, "Prefill attention on the tiles")."""
        return not self.generic and self.kernels is not None and self.cpu.amx

    def layer_ops(self, reference: bool = False):
        """The fused C++ layer ops where built, the generic path's Triton ones where chosen,
        else the torch reference (always for the reference attention backend: a pure-torch
        oracle)."""
        if reference:
            return TorchLayerOps
        if self.generic and self.generic_layer_ops == "triton":
            from pagedllm.backends.triton_layer_ops import TritonLayerOps

            return TritonLayerOps
        return TorchLayerOps if self.kernels is None else self.kernels

    def describe(self) -> str:
        if self.generic:
            return f"generic torch path on {self.device}"
        level = self.cpu.summary if self.kernels is not None else "none, torch fallback"
        return f"{self.name} ({level} kernels)"


def cpu_backend() -> Backend:
    """This process's CPU backend, at the level PAGEDLLM_CPU_ISA asks for (else the best this
    CPU runs). Raises UnsupportedISAError for a level the CPU cannot run."""
    return Backend("cpu", "cpu", capabilities(), kernel_ops(), torch_ops())


def generic_backend(device: str, attention: str | None = None,
                    layer_ops: str | None = None) -> Backend:
    """The generic torch path on `device` ("cuda": the CUDA backend, its attention and layer
    ops in Triton; "cpu": the same code on this CPU, which is how CI runs it, in torch
    unless asked)."""
    attention = attention or ("triton" if device == "cuda" else "batched")
    layer_ops = layer_ops or ("triton" if device == "cuda" else "torch")
    return Backend("torch", device, capabilities(), None, torch_ops(), attention, layer_ops)
