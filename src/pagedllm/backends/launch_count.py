"""How many kernels a piece of model code launches, counted without a GPU: every ATen op that
does work (views, allocations and shape queries launch nothing) and every Triton kernel
launch (compiled on a GPU, interpreted on the CPU). On a GPU a decode step of a small batch
costs about its launches times a few microseconds each, CUDA graph or not, so this count is
the figure to keep low (BENCHMARKS.md, "Kernels per decode step"); it is deterministic, so
a test can hold it where a timing could not.

On the CPU an op may run as a different number of host loops than a GPU would launch
kernels for it; the count is the number of ops a GPU backend would launch, which is what
the tests and the benchmark compare."""
from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that launch no kernel: views, allocations, metadata.
_NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "t", "transpose",
    "permute", "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes",
    "expand", "alias", "detach", "detach_", "unbind", "flatten", "narrow", "chunk",
    "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "size", "stride",
    "sym_size", "sym_stride", "is_contiguous", "numpy_T", "_local_scalar_dense"})


class LaunchCount:
    """Launches by name; `by_scope` splits them by the innermost scope's module running (a
    launch counts in one scope only)."""

    def __init__(self):
        self.total: collections.Counter[str] = collections.Counter()
        self.by_scope: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.scopes = ["outside"]  # the innermost module running is the last
        self._inside_triton = 0

    def add(self, name: str) -> None:
        self.total[name] += 1
        self.by_scope[self.scopes[-1]][name] += 1

    def launches(self, scope: str | None = None) -> int:
        return sum((self.total if scope is None else self.by_scope[scope]).values())


class _Ops(TorchDispatchMode):
    def __init__(self, count: LaunchCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.count._inside_triton and name not in _NO_LAUNCH:
            self.count.add(name)
        return func(*args, **(kwargs or {}))


def _triton_launchers():
    """The classes whose `run` launches a Triton kernel: the compiled one and the
    interpreter's (whichever this process uses)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction, InterpretedFunction


@contextlib.contextmanager
def count_launches(scopes: dict[str, torch.nn.Module] | None = None):
    """with count_launches({"layer": model.stack.layers[0]}) as count: ... — every launch
    inside, by name; those made while a given module runs also under its scope name (the
    innermost one's, where scopes nest; "outside" where none runs)."""
    count = LaunchCount()
    patched = []
    for cls in _triton_launchers():
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            count.add("triton:" + self.fn.__name__ if hasattr(self, "fn") else "triton")
            count._inside_triton += 1  # the interpreter's own torch calls are not launches
            try:
                return _original(self, *args, **kwargs)
            finally:
                count._inside_triton -= 1

        cls.run = run
        patched.append((cls, original))
    hooks = []
    for name, module in (scopes or {}).items():
        def enter(_module, _args, _name=name):
            count.scopes.append(_name)

        def leave(_module, _args, _out):
            count.scopes.pop()

        hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with _Ops(count):
            yield count
    finally:
        for hook in hooks:
            hook.remove()
        for cls, original in patched:
            cls.run = original
