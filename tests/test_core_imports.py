"""The core (config, request, KV-cache bookkeeping, scheduler, fair queue, step records, CPU
level choice and the kernel probes' package, grammar specs and tool calls) is plain data: importing it loads no torch, so it
is tested and used without the model stack."""
import os
import subprocess
import sys

CORE_MODULES = ["pagedllm", "pagedllm.config", "pagedllm.core.request", "pagedllm.core.kv_cache",
                "pagedllm.core.scheduler", "pagedllm.core.step_records", "pagedllm.core.fair_queue",
                "pagedllm.core.output_processor", "pagedllm.core.sizing", "pagedllm.kernels",
                # what a request asks of its output is plain data too
                "pagedllm.errors", "pagedllm.structured.spec", "pagedllm.tool_calls.spec", "pagedllm.tool_calls.parser",
                "pagedllm.tool_calls.syntax", "pagedllm.tool_calls.prompt"]


def test_core_imports_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in CORE_MODULES)
            + "heavy = sorted(m for m in ('torch', 'numpy', 'pagedllm.engine.engine', 'pagedllm.models') "
            "if m in sys.modules)\nprint(heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_scheduler_and_kv_cache_tests_run_without_torch():
    tests = os.path.dirname(__file__)
    code = ("import sys, pytest\n"
            f"rc = pytest.main(['-q', '-p', 'no:cacheprovider', '{tests}/test_scheduler.py', "
            f"'{tests}/test_block_pool.py', '{tests}/test_fairness.py'])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
            "sys.exit(int(rc))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(tests))
    assert done.returncode == 0, done.stdout[-2000:]
    assert done.stdout.strip().endswith("no torch"), done.stdout[-2000:]
    assert " passed" in done.stdout


def test_package_names_still_resolve_lazily():
    import pagedllm
    from pagedllm.engine.llm import LLM

    assert pagedllm.LLM is LLM and pagedllm.SamplingParams.__name__ == "SamplingParams"
    try:
        pagedllm.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("unknown names must raise AttributeError")


def test_seeded_streams_live_with_the_runner_and_go_with_their_request(tiny_llama_gguf):
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama_gguf), kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    first = llm.generate("hello there", params)[0].token_ids
    assert llm.generate("hello there", params)[0].token_ids == first  # same seed, same tokens
    assert llm.engine.runner.generators == {}  # finished requests leave nothing behind
    llm.engine.add_request("r1", "hello there", params)
    llm.engine.step()
    assert set(llm.engine.runner.generators) == {"r1"}
    llm.engine.abort_request("r1")
    assert llm.engine.runner.generators == {}


def test_the_single_process_server_never_imports_ray():
    """Ray is the optional extra of `serve --replicas` only."""
    code = ("import sys\nimport pagedllm.cli.main, pagedllm.cli.serve, pagedllm.server.app, "
            "pagedllm.server.runner\nprint(sorted(m for m in sys.modules if m == 'ray' "
            "or m.startswith(('ray.', 'pagedllm.replicas'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
