"""Where a model store finds a model's LoRA adapters (serving/model_store.py): beside it in
`NAME.loras/`, or in its [models] entry's `loras`."""
from __future__ import annotations

import os


def adapters_beside(folder: str, model: str) -> tuple[tuple[str, str], ...]:
    """The adapters in `folder/MODEL.loras/`: PEFT folders and GGUF files, by their names."""
    loras = os.path.join(folder, model + ".loras")
    if not os.path.isdir(loras):
        return ()
    found = []
    for name in sorted(os.listdir(loras)):
        path = os.path.abspath(os.path.join(loras, name))
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            found.append((name, path))
        elif os.path.isfile(path) and name.lower().endswith(".gguf"):
            found.append((name[:-len(".gguf")], path))
    return tuple(found)


def is_gguf_adapter(path: str) -> bool:
    from pagedllm.weights.gguf_file import GGUFFile, GGUFFormatError

    try:
        return GGUFFile(path).fields.get("general.type") == "adapter"
    except (GGUFFormatError, OSError, ValueError):
        return False  # not this check's to refuse: loading it says why


def table_loras(item, base_dir: str) -> tuple[tuple[str, str], ...] | None:
    """`loras = ["NAME=PATH", ...]` or `loras = {NAME = "PATH"}`; None for anything else."""
    if isinstance(item, list) and all(isinstance(v, str) and "=" in v for v in item):
        pairs = [tuple(v.split("=", 1)) for v in item]
    elif isinstance(item, dict) and all(isinstance(v, str) for v in item.values()):
        pairs = list(item.items())
    else:
        return None
    return tuple((name, os.path.abspath(os.path.join(base_dir, os.path.expanduser(path))))
                 for name, path in pairs)


