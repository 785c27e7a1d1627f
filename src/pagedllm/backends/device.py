"""`--device auto|cpu|cuda`: which backend an engine gets, decided once, with a clear error
where the asked-for device cannot be used."""
from __future__ import annotations

import logging

import torch

from pagedllm.backends.cpu import Backend, cpu_backend
from pagedllm.config import DEVICES

logger = logging.getLogger("pagedllm")



class DeviceError(ValueError):
    """The asked-for device cannot run this server; the message says why and what to do."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def choose_backend(device: str = "auto") -> Backend:
    """auto: the CPU today, saying so where a GPU is seen (the CUDA backend is not built
    yet); cpu: the CPU; cuda: refused, with why."""
    check_device(device)
    if device == "auto" and cuda_available():
        logger.warning("a CUDA GPU is visible, but pagedllm's CUDA backend is not built yet: "
                       "serving on the CPU")
    return cpu_backend()


def check_device(device: str) -> None:
    """DeviceError where `device` cannot serve here (cheap: builds no backend)."""
    if device not in DEVICES:
        raise DeviceError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda":
        if not cuda_available():
            build = torch.__version__
            where = ("this torch is a CPU-only build" if torch.version.cuda is None
                     else f"torch {build} is built for CUDA {torch.version.cuda} but sees no GPU")
            raise DeviceError(f"--device cuda: no usable CUDA GPU ({where}); serve with "
                              f"--device cpu (or --device auto)")
        raise DeviceError("--device cuda: a GPU is here, but pagedllm's CUDA backend is not "
                          "built yet (only its Triton paged attention is); serve with --device cpu")
