"""Catching the reads that would make the host wait for a CUDA device, on a CPU.

On a CPU every tensor is on "the device", so a read is a read only of what the device computed:
the catcher taints the tensors that come from device state (the model's weights and buffers,
the KV cache) and everything computed from them, and flags, on a tainted tensor, the calls that
copy a value to the host and so synchronise on CUDA: `tolist`, `item`, `numpy`, `__bool__` /
`__int__` / `__float__` / `__index__` (each `aten._local_scalar_dense`), `nonzero` (its output size
is data-dependent), and indexing or `index_put_` with a boolean mask (a `nonzero` inside).
Tensors the host made itself (a list turned into a tensor, then copied to the device) are not
tainted: on CUDA those are host-to-device copies, which do not wait.

Reads inside an allowed region (`allow`, the verdict read) and kernels launched through Triton's
interpreter (which runs a device kernel as numpy on the host) are not flagged.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

ROOT = str(Path(__file__).resolve().parents[1]) + "/"

aten = torch.ops.aten

READS = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"}
SCALAR_READ = {aten._local_scalar_dense.default}
DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


@dataclass
class Read:
    what: str
    where: str


@dataclass
class SyncCatcher:
    """Taints `sources` and everything computed from them; records the reads of tainted values."""

    reads: list[Read] = field(default_factory=list)
    _tainted: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    _allowed: int = 0

    def taint(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self._tainted[t] = True

    def tainted(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x in self._tainted

    def record(self, what: str) -> None:
        if self._allowed:
            return
        ours = [
            f
            for f in traceback.extract_stack()
            if f.filename.startswith(ROOT) and not f.filename[len(ROOT) :].startswith(("tests/", "."))
        ]
        where = f"{ours[-1].filename[len(ROOT) :]}:{ours[-1].lineno}" if ours else "?"
        self.reads.append(Read(what, where))

    @contextlib.contextmanager
    def allow(self) -> Iterator[None]:
        self._allowed += 1
        try:
            yield
        finally:
            self._allowed -= 1

    @contextlib.contextmanager
    def watching(self) -> Iterator[SyncCatcher]:
        with _Functions(self), _Dispatch(self):
            yield self


class _Functions(TorchFunctionMode):
    def __init__(self, catcher: SyncCatcher) -> None:
        super().__init__()
        self.catcher = catcher

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS and args and self.catcher.tainted(args[0]):
            self.catcher.record(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __init__(self, catcher: SyncCatcher) -> None:
        super().__init__()
        self.catcher = catcher

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        c = self.catcher
        flat, _ = tree_flatten((args, kwargs))
        dirty = any(c.tainted(x) for x in flat)
        if dirty and func in SCALAR_READ:
            c.record(str(func))
        elif dirty and func in DATA_DEPENDENT:
            c.record(str(func))
        elif func in INDEXING:
            index = args[1] if len(args) > 1 else []
            masks = [i for i in (index or []) if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
            if any(c.tainted(m) for m in masks):
                c.record(f"{func} with a boolean mask")
        out = func(*args, **kwargs)
        if dirty:
            c.taint(x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))
        # an in-place write of device data into a host tensor makes it device data
        if dirty and func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            c.taint([args[0]])
        return out
