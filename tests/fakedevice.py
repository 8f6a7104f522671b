"""A fake CUDA device on the CPU-only torch build, for the device audit (issue 21, ADR 0016).

`FakeTensorMode` gives tensors that carry a device, a shape and a dtype but no data. With it,
a worker's step runs "on CUDA" here:
- a host tensor meeting a CUDA one raises (`FakeTensorDeviceMismatchError`), as on a GPU;
- reading a value back (`.item()`, `.tolist()`, `bool(t)`, `if t.any():`, a boolean-mask
  index) raises: the data is not there, just as on a GPU it would be a device sync;
- a copy to the host (`.cpu()`, `.to("cpu")`, `.numpy()`) is recorded by `HostCopies`, so the
  audit can fail on any copy except through the one designated transfer.

One thing the CPU-only build cannot do: Python indexing (`t[1:3]`, `t[:, None]`, `t[idx] = v`)
takes a CUDA device guard in C++ before dispatch and raises "PyTorch is not linked with
support for cuda devices" (ops called as functions never take it). `LowerIndexing` lowers
`__getitem__` / `__setitem__` to the aten ops PyTorch's own indexing calls (select, slice,
unsqueeze, index, index_put_), in the same order, so the step's code runs unchanged and every
op still meets the fake-tensor checks. `torch.tensor(data, device="cuda")` is lowered the
same way, to a host tensor and a copy in (a one-element list takes the guard otherwise).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose CUDA kernels read a value back to the host (a synchronisation, refused while a
# stream is capturing): on the fake device they run without complaint, so the audit names
# them. `masked_fill` with a tensor value calls `value.item()` on CUDA (a 0-dim device tensor
# included: the first H200 call of session 21 failed its capture on exactly that); the others
# size their output from the data.
SYNCS_ON_CUDA = frozenset({
    aten.masked_fill.Tensor, aten.masked_fill_.Tensor, aten.nonzero.default, aten.masked_select.default,
    aten.repeat_interleave.Tensor, aten._unique2.default, aten.unique_consecutive.default, aten.equal.default,
    aten.is_nonzero.default, aten._local_scalar_dense.default,
})
# indexing with a boolean mask (`x[m]`, `x[m] = v`) turns the mask into positions with a
# `nonzero` inside the kernel's C++ (a synchronisation the trace cannot see as an op of its own)
BOOL_INDEXED = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                          aten._index_put_impl_.default})


def _expand(t: torch.Tensor, idx) -> tuple:
    """The index as a tuple with Ellipsis spelled out as whole-dimension slices."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    consumed = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
                   for i in idx if i is not None and i is not Ellipsis)
    out: list = []
    for i in idx:
        out.extend([slice(None)] * (t.dim() - consumed) if i is Ellipsis else [i])
    return tuple(out)


def _basic(t: torch.Tensor, idx) -> tuple[torch.Tensor, list]:
    """Basic indexing (int, slice, None) applied as views, in PyTorch's order; returns the
    view and, per dimension of it, the advanced (tensor) index or None (taken whole)."""
    out, dim, adv = t, 0, []
    for i in _expand(t, idx):
        if i is None:
            out = aten.unsqueeze.default(out, dim)
            adv.append(None)
            dim += 1
        elif isinstance(i, bool):
            raise NotImplementedError("a boolean scalar index")
        elif isinstance(i, int):
            out = aten.select.int(out, dim, i)
        elif isinstance(i, slice):
            out = aten.slice.Tensor(out, dim, i.start, i.stop, 1 if i.step is None else i.step)
            adv.append(None)
            dim += 1
        else:
            adv.append(i if isinstance(i, torch.Tensor) else torch.tensor(i, device=t.device))
            dim += 1
    adv += [None] * (out.dim() - len(adv))
    return out, adv


def getitem(t: torch.Tensor, idx) -> torch.Tensor:
    view, adv = _basic(t, idx)
    if all(a is None for a in adv):
        return view
    return aten.index.Tensor(view, adv)


def setitem(t: torch.Tensor, idx, value) -> None:
    view, adv = _basic(t, idx)
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=t.dtype, device=t.device)
    if all(a is None for a in adv):
        aten.copy_.default(view, value.expand_as(view))
    else:
        aten.index_put_.default(view, adv, value)


def to(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`Tensor.to` as aten's `_to_copy` (returns `t` itself when nothing changes, as torch does)."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, (str, torch.device, int)):
            device = a
    device = t.device if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    dtype = t.dtype if dtype is None else dtype
    if device == t.device and dtype == t.dtype and not kwargs.get("copy", False):
        return t
    return aten._to_copy.default(t, dtype=dtype, device=device, non_blocking=kwargs.get("non_blocking", False))


class LowerIndexing(TorchFunctionMode):
    """`t[...]`, `t[...] = v` and `t.to(cuda)` through aten ops (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            return getitem(*args)
        if func is torch.Tensor.__setitem__:
            return setitem(*args)
        if func is torch.Tensor.to:
            return to(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return to(args[0], "cuda" if len(args) < 2 else args[1])
        if func is torch.Tensor.__invert__:  # (the binding takes the guard; the op is bitwise_not)
            return aten.bitwise_not.default(args[0])
        if func is torch.Tensor.copy_:  # (a copy between devices takes the guard too)
            return aten.copy_.default(args[0], args[1], kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        if func is torch.Tensor.pin_memory:  # (this build has no pinned memory: the data stays as it is)
            return args[0]
        if func is torch.Tensor.numpy and not isinstance(args[0], FakeTensor):
            with unset_fake_temporarily():  # a real host tensor's data (the designated copy's stand-in)
                return func(*args, **kwargs)
        if func is torch.tensor and torch.device(kwargs.get("device") or "cpu").type == "cuda":
            # data from Python made on the host, then copied in (what CUDA does); the build's own
            # path for a one-element list takes the CUDA guard
            device = kwargs.pop("device")
            return to(func(*args, **kwargs), device)
        return func(*args, **kwargs)


class HostCopies(TorchDispatchMode):
    """Records every copy of a device tensor to the host (the op and the shape), and every
    blocking copy from the host to the device: on CUDA a copy from pageable memory waits for
    every kernel queued before it (`device.py: to_device` copies without waiting)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, tuple[int, ...]]] = []
        self.blocking_in: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (func in (aten._to_copy.default, aten.copy_.default) and src is not None
                and isinstance(out, torch.Tensor)):
            frm = args[1] if func is aten.copy_.default else src
            if frm.device.type != "cpu" and out.device.type == "cpu":
                self.copies.append((str(func), tuple(frm.shape)))
            non_blocking = kwargs.get("non_blocking", args[2] if func is aten.copy_.default and len(args) > 2
                                      else False)
            if frm.device.type == "cpu" and out.device.type == "cuda" and not non_blocking:
                self.blocking_in.append(tuple(frm.shape))
        return out


@contextmanager
def fake_cuda() -> Iterator[tuple[FakeTensorMode, HostCopies]]:
    """Fake CUDA tensors with indexing lowered and host copies recorded. Real host tensors
    (a request's data from the wire) may enter: they become fake host tensors, so one that
    meets a CUDA tensor without being copied in still raises."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, LowerIndexing(), HostCopies() as copies:
        yield mode, copies


class OpTrace(TorchDispatchMode):
    """The graph-safety audit's recorder (ADR 0019): every op a function runs, with each
    tensor it reads described either as a buffer that existed before (its storage, shape,
    strides, offset: a CUDA graph replays reads of exactly these addresses) or as one made
    during the function (its shape and dtype only), and every copy from the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.made: set[int] = set()
        self.from_host: list[str] = []
        self.read: set[int] = set()  # storages of buffers from before that the function read
        self.syncs: list[str] = []  # ops that would read a value back on CUDA (SYNCS_ON_CUDA)

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _describe(self, t: torch.Tensor) -> tuple:
        if self._key(t) in self.made:
            return ("made", tuple(t.shape), str(t.dtype))
        self.read.add(self._key(t))
        return ("buffer", self._key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in ins if t.dim() > 0 or t.device.type != "cpu"}
        if "cpu" in devices or (func in (aten._to_copy.default, aten.copy_.default) and any(
                t.device.type == "cpu" for t in ins)):
            self.from_host.append(str(func))
        if func in SYNCS_ON_CUDA or (func in BOOL_INDEXED and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])):
            self.syncs.append(str(func))
        desc = tuple(self._describe(t) for t in ins)
        out = func(*args, **kwargs)
        seen = {self._key(t) for t in ins}
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outs:
            if self._key(t) not in seen:
                self.made.add(self._key(t))
        self.ops.append((str(func), desc, tuple(tuple(t.shape) for t in outs)))
        return out


def audit_runs(traces: list[OpTrace], allowed: set[int]) -> list[str]:
    """What makes a function unsafe to replay from one CUDA graph, over several calls that
    should share one (the same bucket): a different op sequence, buffers or shapes between
    calls (a graph replays exactly the first), a read of a buffer outside `allowed` (the
    weights, the KV and the step's persistent buffers: anything else was made for one step),
    a copy from the host inside it, or an op that reads a value back on CUDA (SYNCS_ON_CUDA).
    Explicit host reads need no check: on the fake device they raise."""
    problems = []
    for i, t in enumerate(traces):
        if t.from_host:
            problems.append(f"call {i} copies from the host: {sorted(set(t.from_host))}")
        if t.syncs:
            problems.append(f"call {i} synchronises with the host on CUDA: {sorted(set(t.syncs))}")
        stray = t.read - allowed
        if stray:
            problems.append(f"call {i} reads {len(stray)} buffers made for this call alone")
        if i and t.ops != traces[0].ops:
            diff = next((j for j, (a, b) in enumerate(zip(t.ops, traces[0].ops, strict=False)) if a != b),
                        min(len(t.ops), len(traces[0].ops)))
            problems.append(f"call {i} differs from call 0 at op {diff} of {len(traces[0].ops)}: "
                            f"{traces[0].ops[diff][0] if diff < len(traces[0].ops) else 'end'}")
    return problems


def storages(*tensors) -> set[int]:
    """The storage keys of tensors (lists, dicts and dataclass fields of them taken apart)."""
    import dataclasses

    out: set[int] = set()

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            out.add(x.untyped_storage()._cdata)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))

    walk(tensors)
    return out
