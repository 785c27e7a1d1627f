"""The backend: chosen once when an engine is built, then handed to the model's constructor.
It owns what differs between machines: where tensors live, which attention and layer ops
run, which implementation each weight format's linear layers get. No model module asks for
kernels on its own. Today: the CPU at its ISA level (cpu.py); the CUDA backend plugs in here
(its paged attention, in Triton, is attention/triton_paged.py; the rest is not built yet)."""
from pagedllm.backends.cpu import Backend, cpu_backend
from pagedllm.backends.device import DeviceError, check_device, choose_backend

__all__ = ["Backend", "DeviceError", "check_device", "choose_backend", "cpu_backend"]
