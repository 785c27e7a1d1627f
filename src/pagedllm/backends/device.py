"""`--device auto|cpu|cuda`: which backend an engine gets, decided once, with a clear error
where the asked-for device cannot be used."""
from __future__ import annotations

import logging

import torch

from pagedllm.backends.cpu import Backend, cpu_backend, generic_backend
from pagedllm.config import DEVICES

# The CUDA backend's code path on the CPU: not a --device choice, what tests run it with.
GENERIC_ON_CPU = "torch-cpu"

logger = logging.getLogger("pagedllm")



class DeviceError(ValueError):
    """The asked-for device cannot run this server; the message says why and what to do."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def choose_backend(device: str = "auto") -> Backend:
    """auto: the GPU where torch sees one, else the CPU; cpu: the CPU's kernels; cuda: the
    generic torch path on the GPU; torch-cpu: that same path on the CPU (tests)."""
    check_device(device)
    if device == "cuda" or (device == "auto" and cuda_available()):
        return generic_backend("cuda")
    if device == GENERIC_ON_CPU:
        return generic_backend("cpu")
    return cpu_backend()


def check_device(device: str) -> None:
    """DeviceError where `device` cannot serve here (cheap: builds no backend)."""
    if device not in DEVICES and device != GENERIC_ON_CPU:
        raise DeviceError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not cuda_available():
        build = torch.__version__
        where = ("this torch is a CPU-only build" if torch.version.cuda is None
                 else f"torch {build} is built for CUDA {torch.version.cuda} but sees no GPU")
        raise DeviceError(f"--device cuda: no usable CUDA GPU ({where}); serve with "
                          f"--device cpu (or --device auto)")
