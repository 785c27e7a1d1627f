"""Shared fixtures. Nothing here imports torch at module level: the scheduler and KV-cache
tests run without it (test_core_imports.py checks), the rest import it themselves."""
import contextlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pagedllm.kernels import ENV_VAR, capabilities, kernels_for  # noqa: E402  (no torch)

NUM_THREADS = max(1, min(2, os.cpu_count() or 1))


def pytest_addoption(parser):
    parser.addoption("--cpu-hogs", type=int, default=0, metavar="N",
                     help="run N busy-looping processes for the whole session, as on a loaded "
                          "CI host (make test-busy): no test may depend on the CPU's speed")


@pytest.fixture(scope="session", autouse=True)
def cpu_hogs(request):
    import subprocess

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(request.config.getoption("--cpu-hogs"))]
    yield len(hogs)
    for hog in hogs:
        hog.kill()
        hog.wait()


def pytest_collection_finish(session):
    # The GPU path's modules switched Triton's interpreter on as they were collected: record
    # its launches, for the compile check on real cards (scripts/compile_gpu_kernels.py).
    if os.environ.get("TRITON_INTERPRET") == "1":
        import triton_launches

        triton_launches.start_recording()


def pytest_sessionfinish(session, exitstatus):
    if "triton_launches" in sys.modules:
        sys.modules["triton_launches"].write()


def pytest_runtest_setup(item):
    # At most 2 compute threads, as on the project's machine, once a test module brought torch.
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != NUM_THREADS:
        torch.set_num_threads(NUM_THREADS)

# Every CPU level this host can run (portable, avx2, avx512): the kernel tests and one
# real-model server test run at each, so an AVX-512 host proves the lower paths too.
ISA_LEVELS = capabilities().available


@contextlib.contextmanager
def isa_level(level: str):
    """Models built inside take the kernels of `level` (PAGEDLLM_CPU_ISA)."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = level
    try:
        yield level
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


@contextlib.contextmanager
def amx_off():
    """Models built inside run without the AMX tiles (PAGEDLLM_CPU_AMX=0): the avx512 level as
    a CPU without them runs it, on a host that has them."""
    from pagedllm.kernels import AMX_ENV_VAR

    before = os.environ.get(AMX_ENV_VAR)
    os.environ[AMX_ENV_VAR] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(AMX_ENV_VAR, None)
        else:
            os.environ[AMX_ENV_VAR] = before


@pytest.fixture(scope="session", params=ISA_LEVELS)
def isa(request):
    """Each CPU level the host can run, in turn."""
    return request.param


@pytest.fixture(scope="session")
def ops(isa):
    """The compiled kernels of one level (make install builds every level the host runs)."""
    module = kernels_for(isa)
    assert module is not None, f"the {isa} C++ kernels must build here (make install builds them)"
    assert module.isa() == isa, "the build's target flags must give the level it is named for"
    return module


@pytest.fixture()
def at_isa(isa):
    """Runs the test with PAGEDLLM_CPU_ISA set to each level in turn."""
    with isa_level(isa):
        yield isa


@pytest.fixture(scope="session")
def tiny_llama():
    from tiny_models import tiny_hf_model

    return tiny_hf_model("llama", tie=True)


@pytest.fixture(scope="session")
def tiny_llama_folder(tiny_llama, tmp_path_factory):
    from tiny_models import write_hf_folder

    return write_hf_folder(tiny_llama, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama, tmp_path_factory):
    from tiny_models import write_gguf

    return write_gguf(tiny_llama, tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def real_llm():
    """The default SmolLM2 model in float32, shared by the tests that need the real thing."""
    from pagedllm import LLM

    return LLM(dtype="float32", kv_cache_memory=512 << 20)


@pytest.fixture(scope="session")
def hf_reference_folder(tmp_path_factory):
    """The bundled GGUF as transformers itself reads it (its own GGUF loader, float32), saved
    once as a Hugging Face folder: every reference model of the session loads from it, bit
    for bit the same weights, in a second instead of the ~30 s transformers' GGUF reader
    takes each time (it parses the whole tokenizer header in Python)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.errors import ModelLoadError
    from pagedllm.weights import default_model_path

    try:
        path = default_model_path()
    except ModelLoadError as exc:
        if os.environ.get("PAGEDLLM_TEST_DEVICE") == "cuda":  # the GPU machine: no room for it
            pytest.skip(str(exc))
        raise
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    # Dequantized already: the GGUF marker only stops save_pretrained (nothing to keep).
    model.hf_quantizer = None
    del model.config.quantization_config
    folder = tmp_path_factory.mktemp("hf_reference")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_reference(hf_reference_folder):
    """Hugging Face transformers on the same GGUF file: the reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_reference_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def trained_loras(tmp_path_factory, hf_reference_folder):
    """Two LoRA adapters trained by peft on the bundled model (tests/lora_adapters.py), each
    answering QUESTION with its own made-up phrase: (the PeftModel holding both, the oracle;
    name -> PEFT folder; zorblax as a GGUF LoRA file)."""
    from lora_adapters import train_adapters, write_gguf_adapter
    from pagedllm.tokenizer import Tokenizer
    from pagedllm.weights import default_model_path

    folder = tmp_path_factory.mktemp("loras")
    model, paths = train_adapters(folder, Tokenizer.from_model_path(default_model_path()),
                                  hf_reference_folder)
    config = model.base_model.model.config
    gguf = write_gguf_adapter(paths["zorblax"], folder / "zorblax.gguf",
                              config.num_attention_heads, config.num_key_value_heads)
    return model, paths, gguf


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One real server process on the default model, shared by the HTTP tests."""
    from server_process import ServerProcess

    log = tmp_path_factory.mktemp("server") / "server.log"
    # float32: outputs must not depend on the batch (bfloat16 switches kernels with batch size).
    proc = ServerProcess("--dtype", "float32", "--kv-cache-memory", str(512 << 20), "--max-num-seqs", "16",
                         "--served-model-name", "smollm2", "--model-alias", "gpt-4o-mini,claude-*",
                         log_path=str(log))
    yield proc
    proc.stop()


@pytest.fixture()
def client(server):
    from openai import OpenAI

    # A bound, not a speed: a loaded 2-core host may take minutes for a batch of answers.
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
