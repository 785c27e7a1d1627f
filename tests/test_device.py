"""`--device auto|cpu|cuda` (backends/device.py): the backend is chosen once; a device that
cannot run says why and the server does not start; the choice shows in the ready line,
/metrics and /v1/models."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from pagedllm.backends import DeviceError, choose_backend
from pagedllm.backends import device as device_module


def test_cpu_and_auto_give_the_cpu_backend():
    assert choose_backend("cpu").device == "cpu"
    assert choose_backend("auto").device == "cpu"


def test_cuda_without_a_gpu_says_why():
    with pytest.raises(DeviceError) as err:
        choose_backend("cuda")
    message = str(err.value)
    assert "no usable CUDA GPU" in message and "--device cpu" in message


def test_cuda_with_a_gpu_gives_the_generic_path_there(monkeypatch, caplog):
    monkeypatch.setattr(device_module, "cuda_available", lambda: True)
    backend = choose_backend("cuda")
    assert (backend.name, backend.device, backend.kernels) == ("torch", "cuda", None)
    assert backend.generic and not backend.prepacks_bfloat16
    # auto on such a machine serves on the CPU until the CUDA backend is asked for by name.
    assert choose_backend("auto").device == "cpu"
    assert "serving on the CPU" in caplog.text and "--device cuda" in caplog.text


def test_the_generic_path_on_the_cpu_is_what_ci_runs():
    backend = choose_backend("torch-cpu")
    assert (backend.name, backend.device, backend.kernels) == ("torch", "cpu", None)
    assert backend.describe() == "generic torch path on cpu"


def test_a_bad_device_name():
    with pytest.raises(DeviceError, match="device must be one of auto, cpu, cuda"):
        choose_backend("tpu")


def test_serve_refuses_cuda_here_with_the_reason():
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--device", "cuda",
                           "--port", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--device cuda: no usable CUDA GPU" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_server_says_where_it_runs(server):
    assert "device: cpu; CPU:" in server.output()
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["device"] == "cpu"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pagedllm:device_info{device="cpu",model_name="smollm2"} 1.0' in metrics
