"""The backend: chosen once when an engine is built, then handed to the model's constructor.
It owns what differs between machines: where tensors live, which attention and layer ops
run, which implementation each weight format's linear layers get. No model module asks for
kernels on its own. The CPU at its ISA level with its C++ kernels (cpu.py: cpu_backend), or
the generic torch path on a device (generic_backend: dense weights, torch's layer ops, paged
attention in Triton on a GPU: attention/triton_backend.py), which is the CUDA backend."""
from pagedllm.backends.cpu import Backend, cpu_backend, generic_backend
from pagedllm.backends.device import DeviceError, check_device, choose_backend

__all__ = ["Backend", "DeviceError", "check_device", "choose_backend", "cpu_backend",
           "generic_backend"]
