"""`--device auto|cpu|cuda` (backends/device.py): the backend is chosen once; a device that
cannot run says why and the server does not start; the choice shows in the ready line,
/metrics and /v1/models."""
from __future__ import annotations

import os
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
    assert choose_backend("auto").device == "cuda"  # auto: the GPU where one is seen


def test_auto_is_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(device_module, "cuda_available", lambda: False)
    backend = choose_backend("auto")
    assert backend.device == "cpu" and not backend.generic


def test_cuda_graphs_are_on_by_default_on_a_gpu_only():
    from pagedllm.cli import build_parser, engine_config
    from pagedllm.config import EngineConfig

    assert EngineConfig().uses_cuda_graphs("cuda") and not EngineConfig().uses_cuda_graphs("cpu")
    assert not EngineConfig(cuda_graphs=False).uses_cuda_graphs("cuda")
    parse = lambda *flags: engine_config(build_parser().parse_args(["serve", *flags]))  # noqa: E731
    assert parse().cuda_graphs is None
    assert parse("--enforce-eager").cuda_graphs is False
    assert parse("--no-cuda-graphs").cuda_graphs is False
    assert parse("--cuda-graphs").cuda_graphs is True


def test_a_mixture_of_experts_runs_eagerly_on_a_gpu_and_refuses_asked_for_graphs(tmp_path):
    """Where its routing counts tokens per expert on the host (moe.py; the torch layer ops:
    the GPU's Triton ones route small steps on the device, tests/test_moe_triton.py), no
    CUDA graph can capture it: by default its decode steps run eagerly, and --cuda-graphs
    is refused, named."""
    from pagedllm import LLM
    from pagedllm.config import EngineConfig
    from tiny_models import tiny_hf_model, write_hf_folder

    assert not EngineConfig().uses_cuda_graphs("cuda", capturable=False)
    assert not EngineConfig(cuda_graphs=False).uses_cuda_graphs("cuda", capturable=False)
    with pytest.raises(ValueError, match="--cuda-graphs: .*mixture-of-experts"):
        EngineConfig(cuda_graphs=True).uses_cuda_graphs("cuda", capturable=False)
    folder = write_hf_folder(tiny_hf_model("mixtral", seed=1), tmp_path / "moe")
    # Off a GPU the device is refused first, before the model loads (the factory asks the
    # same uses_cuda_graphs above once the model says it cannot be captured).
    with pytest.raises(ValueError, match="--cuda-graphs needs --device cuda"):
        LLM(folder, dtype="float32", kv_cache_memory=8 << 20, device="torch-cpu",
            cuda_graphs=True)
    dense = LLM(write_hf_folder(tiny_hf_model("llama", seed=1), tmp_path / "dense"),
                dtype="float32", kv_cache_memory=8 << 20, device="torch-cpu")
    moe = LLM(folder, dtype="float32", kv_cache_memory=8 << 20, device="torch-cpu")
    assert dense.engine.runner.model.max_graph_batch is None  # any batch
    assert moe.engine.runner.model.max_graph_batch == 0


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


def test_make_install_cuda_refuses_a_machine_without_a_cuda_torch(tmp_path):
    """`make install-cuda` uses the machine's own torch and never pulls one: here (no GPU)
    it stops at its first check, saying why, having installed nothing."""
    done = subprocess.run(["make", "-s", "install-cuda", f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode != 0
    assert "install-cuda:" in done.stderr and "install torch for the card first" in done.stderr
    site = list((tmp_path / "venv").glob("lib/python*/site-packages"))
    assert site and not any(site[0].glob("pagedllm*"))  # nothing installed


def test_the_cuda_check_names_a_cpu_only_torch():
    """This venv's torch is the CPU build: the check says so."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "scripts", "check_cuda_torch.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "a CPU-only build" in done.stderr
