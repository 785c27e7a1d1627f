"""CPU levels: which one a CPU gets (from its flags, never from the compiler), the
PAGEDLLM_CPU_ISA override and its errors, the per-level builds, and the real server on the
default model at every level this host runs."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ISA_LEVELS
from pagedllm import kernels
from pagedllm.kernels import build, cpu
from pagedllm.kernels.cpu import REQUIRED_FLAGS, UnsupportedISAError, best_level, resolve_level

ZEN3 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2".split())
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
SAPPHIRE_RAPIDS = SKYLAKE_X | {"avx512_bf16", "avx512_vnni", "amx_bf16"}


@pytest.mark.parametrize("machine,flags,expected", [
    ("x86_64", frozenset({"sse2", "avx"}), "portable"),       # Sandy Bridge: no AVX2
    ("x86_64", ZEN3 - {"f16c"}, "portable"),                  # AVX2 without F16C is not enough
    ("x86_64", ZEN3, "avx2"),
    ("x86_64", SKYLAKE_X, "avx2"),                            # AVX-512 without BF16/VNNI
    ("x86_64", SAPPHIRE_RAPIDS, "avx512"),
    ("AMD64", SAPPHIRE_RAPIDS, "avx512"),
    ("aarch64", frozenset({"fp", "asimd", "asimddp"}), "portable"),
    ("aarch64", SAPPHIRE_RAPIDS, "portable"),                 # x86 flags mean nothing there
])
def test_best_level_comes_from_the_cpu_flags(machine, flags, expected):
    assert best_level(machine, flags) == expected


def test_each_level_needs_what_the_one_below_needs():
    levels = cpu.LEVELS
    for lower, higher in zip(levels, levels[1:]):
        assert REQUIRED_FLAGS[lower] < REQUIRED_FLAGS[higher]


@pytest.mark.parametrize("best,requested,expected", [
    ("avx512", None, "avx512"), ("avx512", "", "avx512"), ("avx512", "avx2", "avx2"),
    ("avx512", " PORTABLE ", "portable"), ("avx2", "avx2", "avx2"), ("portable", "portable", "portable"),
])
def test_requested_level_may_be_lower(best, requested, expected):
    assert resolve_level(best, requested) == expected


def test_requested_level_above_the_cpu_or_unknown_is_a_clear_error():
    with pytest.raises(UnsupportedISAError, match="asks for more than this CPU has.*up to avx2.*avx512_bf16"):
        resolve_level("avx2", "avx512")
    with pytest.raises(UnsupportedISAError, match="up to portable"):
        resolve_level("portable", "avx2")
    with pytest.raises(UnsupportedISAError, match="'sse9' is not a level; choose one of portable, avx2, avx512"):
        resolve_level("avx512", "sse9")


def test_this_host_record(monkeypatch):
    monkeypatch.delenv(cpu.ENV_VAR, raising=False)
    caps = kernels.capabilities()
    assert caps.level == caps.best and caps.available[-1] == caps.best
    assert caps.available == ISA_LEVELS and caps.available[0] == "portable"
    if sys.platform == "linux":
        assert caps.flags, "/proc/cpuinfo has the flags"
    monkeypatch.setenv(cpu.ENV_VAR, "portable")
    assert kernels.capabilities().level == "portable" and not kernels.capabilities().native_bf16
    assert kernels.kernel_ops().isa() == "portable"


def test_kernels_for_a_level_the_cpu_lacks_refuses(monkeypatch):
    avx2_host = cpu.Capabilities("x86_64", ZEN3, "avx2", "avx2")
    monkeypatch.setattr(kernels, "capabilities", lambda: avx2_host)
    with pytest.raises(UnsupportedISAError, match="cannot run the avx512 kernels"):
        kernels.kernels_for("avx512")


def test_builds_are_keyed_by_level_and_flags():
    names = {build.module_name(level) for level in cpu.LEVELS}
    assert len(names) == 3 and all(n.startswith(f"pagedllm_kernels_{lvl}_") for n, lvl in
                                   zip(sorted(names), sorted(cpu.LEVELS)))
    assert "-march=native" not in " ".join(build.COMMON_FLAGS + sum(build.X86_TARGET_FLAGS.values(), ()))
    assert build.target_flags("portable", "x86_64") == ()
    assert "-mavx512bf16" in build.target_flags("avx512", "x86_64")
    assert "-mavx512f" not in build.target_flags("avx2", "x86_64")
    assert build.target_flags("portable", "aarch64") == ()  # the ARM64 build: baseline NEON
    with pytest.raises(ValueError, match="only on x86-64"):
        build.target_flags("avx2", "aarch64")


def test_cli_refuses_a_bad_level_before_loading():
    env = {**os.environ, cpu.ENV_VAR: "avx1024"}
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--port", "1"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "error: PAGEDLLM_CPU_ISA='avx1024' is not a level" in done.stderr


# Below avx512 the server runs as on a CPU without AVX-512: torch's own kernels and oneDNN
# are capped too (ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN refuse bf16 exactly as it did on the
# AVX2-only host that crashed at start), so no path that needs more can hide behind them.
HOST_LIKE = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
             "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}}


@pytest.mark.slow
@pytest.mark.parametrize("level", ISA_LEVELS)
def test_server_serves_at_every_level(level, tmp_path):
    """The real server on the default model in bfloat16 (the 4-bit kernels, the C++ decode
    loop) at each level, through the official client; startup line and /metrics say which."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from server_process import ServerProcess

    proc = ServerProcess("--kv-cache-memory", str(64 << 20), "--served-model-name", "smollm2",
                         log_path=str(tmp_path / "log"), env={cpu.ENV_VAR: level, **HOST_LIKE.get(level, {})})
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        done = client.completions.create(model="smollm2", prompt="The capital of France is",
                                         max_tokens=8, temperature=0)
        assert "Paris" in done.choices[0].text and done.usage.completion_tokens == 8
        chat = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=12)
        assert chat.choices[0].message.content.strip()
        text = httpx.get(proc.url + "/metrics").text
        [info] = [f for f in text_string_to_metric_families(text) if f.name == "pagedllm:cpu_info"]
        assert info.samples[0].labels["isa"] == level
        assert info.samples[0].labels["best_isa"] == ISA_LEVELS[-1]
        # AMX tiles only at avx512, where the CPU and OS give them (tests/test_amx.py)
        tiles = level == "avx512" and kernels.capabilities().amx
        assert info.samples[0].labels["amx"] == str(tiles).lower()
        # 16-bit activations at avx2 always, at avx512 on the CPUs that prefer them
        # (tests/test_int16_products.py); the server runs at `level` with the suite's environment
        int16 = cpu.int16_products(level, cpu.cpu_vendor(), os.environ.get(cpu.INT16_ENV_VAR))
        assert info.samples[0].labels["int16"] == str(int16).lower()
        assert f"CPU kernels: {level}{'+amx' if tiles else ''} (" in proc.output()
    finally:
        assert proc.stop() == 0


CROSS_COMPILER = "aarch64-linux-gnu-g++"


@pytest.mark.skipif(shutil.which(CROSS_COMPILER) is None,
                    reason=f"{CROSS_COMPILER} missing (make install puts it there with apt-get)")
def test_portable_build_compiles_for_aarch64():
    """No aarch64 host here, so the ARM64 claim is checked the one way this machine can: every
    kernel source through the aarch64 compiler with the portable level's flags (its target:
    the baseline, NEON), with torch's headers. It proves no x86-only code outside the x86
    branches; running the kernels on ARM64 stays untested."""
    import sysconfig
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import include_paths

    includes = [arg for path in include_paths() + [sysconfig.get_paths()["include"]]
                for arg in ("-isystem", path)]
    flags = [*build.COMMON_FLAGS, *build.target_flags("portable", "aarch64")]
    # A pass is remembered by everything it depends on (compiler, torch, flags, every kernel
    # source and header), like a build cache: unchanged sources are not checked again (the
    # check takes ~80 s of torch headers), any change is.
    import hashlib
    import glob

    import torch

    digest = hashlib.sha256(subprocess.run([CROSS_COMPILER, "--version"], capture_output=True,
                                           text=True).stdout.encode())
    digest.update(" ".join([torch.__version__, *flags]).encode())
    kernel_dir = os.path.dirname(build.SOURCES[0])
    for path in sorted(glob.glob(os.path.join(kernel_dir, "*.cpp")) + glob.glob(os.path.join(kernel_dir, "*.h"))):
        with open(path, "rb") as f:
            digest.update(f.read())
    passed = os.path.join(os.path.expanduser("~/.cache/pagedllm/aarch64-syntax"), digest.hexdigest())
    if os.path.exists(passed):
        return

    def check(source):
        return subprocess.run([CROSS_COMPILER, "-std=c++17", "-fsyntax-only", *flags,
                               "-DTORCH_EXTENSION_NAME=pagedllm_kernels_aarch64", *includes, source],
                              capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(check, build.SOURCES))
    failed = {src: r.stderr[-2000:] for src, r in zip(build.SOURCES, results) if r.returncode}
    assert not failed, failed
    os.makedirs(os.path.dirname(passed), exist_ok=True)
    open(passed, "w").close()


def test_a_stale_build_lock_is_cleared_and_a_live_one_named(tmp_path, monkeypatch, caplog):
    """A server stopped while it compiled leaves torch's build lock behind, and the next start
    would wait on it forever: an old lock goes, a young one is named in a warning."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_kernels" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    with caplog.at_level("WARNING", logger="pagedllm.kernels"):
        build._check_lock("some_kernels")
    assert lock.exists() and "waiting for another process" in caplog.text
    old = lock.stat().st_mtime - build.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    build._check_lock("some_kernels")
    assert not lock.exists() and "removing a stale kernel build lock" in caplog.text
    build._check_lock("some_kernels")  # no lock: nothing to do


def test_a_quiet_build_lock_is_cleared_without_waiting_15_minutes(tmp_path, monkeypatch, caplog):
    """A killed build's lock a minute old, with nothing compiling in its folder, goes at
    once; the same lock while a process works in that folder (as ninja does) is kept."""
    import subprocess

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "some_kernels"
    folder.mkdir()
    lock = folder / "lock"
    minute_ago = os.path.getmtime(tmp_path) - 60

    def make_lock():
        lock.write_text("")
        os.utime(lock, (minute_ago, minute_ago))

    make_lock()
    worker = subprocess.Popen(["sleep", "30"], cwd=folder)
    try:
        with caplog.at_level("WARNING", logger="pagedllm.kernels"):
            build._check_lock("some_kernels")
        assert lock.exists() and "waiting for another process" in caplog.text
    finally:
        worker.kill()
        worker.wait()
    build._check_lock("some_kernels")
    assert not lock.exists() and "no build at work" in caplog.text


def test_a_build_reports_its_progress_by_level_and_file(tmp_path, monkeypatch, capsys):
    """`python -m pagedllm.kernels` says which level it compiles, how many files are done and
    for how long; by default only the level serving uses, --all every level."""
    import time

    from pagedllm.kernels import __main__ as kernels_main

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    level = "portable"
    folder = tmp_path / build.module_name(level)
    folder.mkdir()
    assert not build.is_built(level) and build.compiled_files(level, 0) == 0

    def slow_build(lvl):  # stands in for g++: two object files appear, then the module
        for source in build.SOURCES[:2]:
            time.sleep(0.15)
            (folder / (os.path.splitext(os.path.basename(source))[0] + ".o")).write_text("")
        time.sleep(0.15)
        return object()

    monkeypatch.setattr(kernels_main, "kernels_for", slow_build)
    monkeypatch.setattr(kernels_main, "PROGRESS_SECONDS", 0.1)
    assert kernels_main.build_with_progress(level)
    out = capsys.readouterr().out
    assert f"{level}: compiling {len(build.SOURCES)} files" in out
    assert "files compiled," in out and f"{level}: built in" in out
    assert build.compiled_files(level, 0) == 2
    (folder / (build.module_name(level) + ".so")).write_text("")
    assert build.is_built(level)
    monkeypatch.setattr(kernels_main, "build_with_progress", lambda lvl: print("built", lvl) or True)
    assert kernels_main.main([]) == 0
    serving_only = capsys.readouterr().out
    assert serving_only.count("built ") == 1
    assert kernels_main.main(["--all"]) == 0
    assert capsys.readouterr().out.count("built ") == len(capabilities_available())


def capabilities_available():
    from pagedllm.kernels import capabilities

    return capabilities().available
