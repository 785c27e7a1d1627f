"""Every Triton launch the GPU-path tests make under the interpreter, recorded (conftest
switches it on) so that scripts/compile_gpu_kernels.py compiles each for real cards without
one. A launch is kept as what Triton specializes a kernel on: each tensor's dtype and 16-byte
alignment, each integer as 1, a multiple of 16, other, or past 32 bits, every constexpr's
value and the launch options (num_warps, num_stages); launches alike in all of these are
one entry."""
from __future__ import annotations

import inspect
import json
import os

LAUNCHES_ENV = "PAGEDLLM_TRITON_LAUNCHES"  # where the session writes them
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "build", "triton-launches.json")

_seen: dict[str, dict] = {}


def _integer(value: int) -> int:
    """A stand-in Triton specializes the same way (== 1, divisible by 16, 64-bit)."""
    if value == 1:
        return 1
    wide = 1 << 33 if abs(value) >= 1 << 31 else 0
    return wide + (16 if value % 16 == 0 else 17)


def describe(value, constexpr: bool):
    import torch
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."),
                "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if constexpr else _integer(value)
    if isinstance(value, float):
        return value if constexpr else 0.5
    raise TypeError(f"a launch argument of type {type(value).__name__} cannot be recorded")


def launch_record(fn, args: tuple, kwargs: dict) -> dict:
    """fn: the kernel's Python function; args, kwargs: as the launch passed them."""
    signature = inspect.signature(fn)
    names = list(signature.parameters)
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    constexprs = {name for name, p in signature.parameters.items()
                  if "constexpr" in str(p.annotation)}
    return {"kernel": f"{fn.__module__}:{fn.__qualname__}",
            "args": {name: describe(value, name in constexprs) for name, value in bound.items()},
            "options": {k: v for k, v in sorted(kwargs.items()) if k not in names}}


def start_recording() -> None:
    """Every interpreted launch from here on is recorded (once per distinct record)."""
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "records_launches", False):
        return
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        record = launch_record(self.fn, args, kwargs)
        _seen.setdefault(json.dumps(record, sort_keys=True), record)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run.records_launches = True
    InterpretedFunction.run = recording_run


def write(path: str | None = None) -> str | None:
    """The session's records as JSON (none: nothing written); returns the path."""
    if not _seen:
        return None
    path = path or os.environ.get(LAUNCHES_ENV) or DEFAULT_PATH
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(sorted(_seen.values(), key=lambda r: json.dumps(r, sort_keys=True)), f,
                  indent=1)
    return path
