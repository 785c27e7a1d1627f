"""The CPU backend: this CPU's level (kernels.capabilities), its compiled C++ kernels (None
without a compiler or with PAGEDLLM_NO_KERNELS) and what this torch build offers besides
(kernels.torch_ops), probed once and carried as one record."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.backends.torch_layer_ops import TorchLayerOps
from pagedllm.kernels import Capabilities, TorchOps, capabilities, kernel_ops, torch_ops


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu"
    device: str  # where tensors live ("cpu")
    cpu: Capabilities
    kernels: object | None  # the compiled module of the level in use
    torch_ops: TorchOps

    @property
    def prepacks_bfloat16(self) -> bool:
        """Whether dense bfloat16 weights are prepacked for oneDNN (else widened to float32:
        a level without bfloat16 arithmetic would only convert them back on every call)."""
        return self.cpu.native_bf16 and self.torch_ops.onednn_prepack

    def layer_ops(self, reference: bool = False):
        """The fused C++ layer ops where built, else the torch reference (always for the
        reference attention backend: a pure-torch oracle)."""
        return TorchLayerOps if reference or self.kernels is None else self.kernels

    def describe(self) -> str:
        level = self.cpu.level if self.kernels is not None else "none, torch fallback"
        return f"{self.name} ({level} kernels)"


def cpu_backend() -> Backend:
    """This process's CPU backend, at the level PAGEDLLM_CPU_ISA asks for (else the best this
    CPU runs). Raises UnsupportedISAError for a level the CPU cannot run."""
    return Backend("cpu", "cpu", capabilities(), kernel_ops(), torch_ops())
