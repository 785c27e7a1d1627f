"""Where the GPU path's tests run. With PAGEDLLM_TEST_DEVICE=cuda (scripts/gpu_check.sh, on a
GPU) they run compiled there; elsewhere on the CPU, Triton under its interpreter, which this
module switches on: import it before anything imports Triton."""
from __future__ import annotations

import os

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "torch-cpu")  # an engine's --device
if DEVICE != "cuda":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

ON = "cuda" if DEVICE == "cuda" else "cpu"  # where the tests' tensors live


def skip_without_the_gpu() -> None:
    """At a module's top: PAGEDLLM_TEST_DEVICE=cuda on a machine without one skips it."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("PAGEDLLM_TEST_DEVICE=cuda without a GPU", allow_module_level=True)


def build_engines_as_on_the_gpu(monkeypatch, layer_ops: str | None = None) -> None:
    """Engines built from here on take the CUDA backend's choices (the Triton attention;
    the layer ops asked for, else the device's): on a GPU its own backend, here the same
    code on the CPU."""
    from pagedllm.backends.cpu import generic_backend
    from pagedllm.engine import factory

    if DEVICE != "cuda":
        monkeypatch.setattr(factory, "choose_backend", lambda device: generic_backend(
            "cpu", attention="triton", layer_ops=layer_ops))
