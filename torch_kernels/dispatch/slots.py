"""Slots and chains: what each op's entry calls per call (:class:`OpSlot` on CUDA, :class:`ReferenceSlot`
elsewhere), resolved on the first call from the plan, and reset with every new selection."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .. import registry
from ..spec import Backend, KernelSpec, Platform
from .planning import plan
from .settings import AUTO, ENV_BACKEND, ENV_STRICT, KernelUnavailableError, _lock, _notice, platform, selection
from .trace import _device_type, _trace, append_line


class Implementation:
    """One backend's implementation of one op, loaded on first use; :meth:`refuses` is the one test of
    whether it takes a call (the chains, the compiled route, the test kit and the benchmarks ask it)."""

    __slots__ = ("op", "spec", "fn", "check", "dtypes", "data_arg", "notice", "run", "started")

    def __init__(self, spec: KernelSpec, data_arg: int, notice: Optional[str] = None) -> None:
        self.op, self.spec, self.data_arg, self.notice = spec.op, spec, data_arg, notice
        self.fn: Optional[Callable[..., Any]] = None
        self.check: Optional[Callable[..., Optional[str]]] = None
        self.dtypes: Optional[frozenset] = None
        self.run = self._first_run
        self.started = False  # set once, under the lock, by the first use

    def load(self) -> None:
        with _lock:
            if self.fn is None:
                import torch

                self.check = self.spec.load_check()
                self.dtypes = frozenset(getattr(torch, d) for d in self.spec.dtypes) or None
                self.fn = self.spec.load()

    def refuses(self, args: tuple) -> Optional[str]:
        """Why this implementation cannot take these arguments, or ``None``."""
        if self.fn is None:
            self.load()
        if self.dtypes is not None and args[self.data_arg].dtype not in self.dtypes:
            return f"dtype {args[self.data_arg].dtype} is not one of {', '.join(self.spec.dtypes)}"
        return self.check(*args) if self.check is not None else None

    def _first_run(self, *args: Any) -> Any:
        self._started(args)
        return self.fn(*args)

    def _started(self, args: tuple, notice: Optional[str] = None) -> None:
        """The first use: load, say the notices, trace; then ``run`` is the backend function itself.
        Under the lock, so that threads making the first call together print each notice once."""
        with _lock:
            if not self.started:
                self.load()
                for line in (self.notice, notice):
                    if line:
                        _notice(line)
                _trace(self.op, self.spec.backend, args, "cuda")  # the CUDA key's implementations
                self.run = self.fn
                self.started = True

    def direct(self, args: tuple) -> Optional[Callable[..., Any]]:
        """The backend function itself when it takes every call of this dtype (no check beyond the
        dtype), else ``None``: what ``auto`` remembers per (dtype, shape)."""
        self.load()
        if self.check is not None or (self.dtypes is not None and args[self.data_arg].dtype not in self.dtypes):
            return None
        self._started(args)
        return self.fn


class OpSlot:
    """What the CUDA entry of one op calls: ``slot.call(*args)``. Resolves on the first call."""

    def __init__(self, op: str, data_arg: int = 0) -> None:
        self.op, self.data_arg = op, data_arg
        self.impls: List[Implementation] = []
        self.under_auto = False  # resolved under DEEPINFER_OPS_BACKEND=auto
        self.call: Callable[..., Any] = self._resolve_and_call

    def reset(self) -> None:
        self.impls = []
        self.call = self._resolve_and_call

    def _resolve_and_call(self, *args: Any) -> Any:
        self._resolve()
        return self.call(*args)

    def _resolve(self) -> None:
        with _lock:
            if self.call == self._resolve_and_call:
                sel = selection()
                chain, notice = plan(self.op)
                self.under_auto = sel.auto  # before impls: sole_server reads it once impls are set
                self.impls = [Implementation(k, self.data_arg, notice if i == 0 else None) for i, k in enumerate(chain)]
                auto = self._auto() if sel.auto and chain else None
                if auto is not None:
                    self.call = auto
                elif not chain:
                    self.call = self._unavailable(notice)
                elif len(chain) == 1 and not chain[0].restricted:
                    self.call = self._single
                else:
                    self.call = _chain_call(self.op, self.impls)

    def server(self, args: tuple) -> Optional[Implementation]:
        """The implementation ``call(*args)`` would run, started (loaded, its first use traced and a
        fallback said), without running it; ``None`` when no selected backend takes the call. What the
        ``out`` entry asks, to hand the call's outputs to a backend that writes them itself."""
        if self.call == self._resolve_and_call:
            self._resolve()
        impls = self.impls
        table = tuned_table() if self.under_auto and impls else None
        if table is not None:
            from .. import tuning

            chosen = tuning.winner(table, self.op, args[self.data_arg])
            if chosen is not None:  # its chain: the bucket's winner first, then the platform default's order
                impls = sorted(impls, key=lambda i: i.spec.backend.value != chosen[0])
        return _taker(self.op, _through_first_unrestricted(impls), args)

    def sole_server(self, args: tuple) -> Optional[KernelSpec]:
        """The implementation that serves every call of this data dtype, as far as its first call has
        shown (no per-call check beyond the dtype, not ``auto``), or ``None``: what ``fast_path.offer``
        may publish."""
        first = self.impls[0] if self.impls and not self.under_auto else None
        if first is None or not first.started or first.check is not None:
            return None
        return first.spec if first.dtypes is None or args[self.data_arg].dtype in first.dtypes else None

    def signature_server(self, args: tuple) -> Optional[KernelSpec]:
        """The implementation that serves this call, the same for every call of its signature (dtypes,
        shapes, strides, argument values: what each backend's check reads), or ``None`` under ``auto``:
        what ``fast_path.run_recording`` may record."""
        impl = self.server(args)  # resolves first: under_auto is the resolved selection's
        return impl.spec if impl is not None and not self.under_auto else None

    def _auto(self) -> Optional[Callable[..., Any]]:
        """Under ``auto``: each call to the chain of its bucket's measured winner (the winner first, then
        the platform default's order; a stale entry's bucket to the platform default, said once), or
        ``None`` when the table has nothing for this op."""
        from .. import tuning

        table = tuned_table()
        if table is None:
            return None
        op = self.op

        def trace(backend: str, bucket: str) -> None:
            path = selection().trace_path
            if path:
                append_line(path, f"{op}|{backend}|auto {bucket}")
        return _auto_call(op, self.impls, self.data_arg, table, trace)

    def _unavailable(self, why: Optional[str]) -> Callable[..., Any]:
        def raise_unavailable(*args: Any) -> Any:
            raise KernelUnavailableError(f"deepinfer::{self.op}: {why}")
        return raise_unavailable

    def _single(self, *args: Any) -> Any:
        impl = self.impls[0]
        out = impl.run(*args)
        self.call = impl.fn  # from now on the backend function itself: no per-call cost here
        return out


def _auto_call(op: str, impls: List[Implementation], data_arg: int, table,
               trace: Callable[[str, str], None]) -> Optional[Callable[..., Any]]:
    """``tuning.auto_call`` over ``impls`` (the platform default's order): per backend, its chain with it first."""
    from .. import tuning

    chains = {i.spec.backend: (_chain_call(op, [i] + [j for j in impls if j is not i]), i.direct) for i in impls}
    return tuning.auto_call(table, op, data_arg, chains, _chain_call(op, impls), trace, _notice)


def auto_function(op: str, data_arg: int = 0, on: Optional[Platform] = None) -> Callable[..., Any]:
    """What the CUDA entry of ``op`` calls per call under ``DEEPINFER_OPS_BACKEND=auto``, whatever the current
    selection: the bucket's winner of the tuned table (:func:`tuned_table`), the platform default's chain where
    the table has nothing (no table, op or dtype not tuned, entry stale). Off CUDA, with no table there, the
    platform default: the reference. The benchmark suite times it beside each backend."""
    on = on or platform()
    impls = [Implementation(k, data_arg) for k in registry.implementations(op) if k.is_available(on)]
    table = tuned_table(on) if on.is_cuda else None
    fn = _auto_call(op, impls, data_arg, table, lambda backend, bucket: None) if table is not None else None
    return fn or _chain_call(op, impls)


def _through_first_unrestricted(impls: List[Implementation]) -> List[Implementation]:
    """``impls`` up to the first that refuses nothing: those after it are never reached."""
    unrestricted = [n for n, i in enumerate(impls) if not i.spec.restricted]
    return impls[:unrestricted[0] + 1] if unrestricted else impls


def _taker(op: str, impls: List[Implementation], args: tuple) -> Optional[Implementation]:
    """The first of ``impls`` that takes the call, started (a fallback's first call says so, once, under
    the lock), or ``None`` when none does."""
    refused = []
    for impl in impls:
        why = impl.refuses(args)
        if why is None:
            if not impl.started:
                impl._started(args, f"op {op!r} served by {impl.spec.backend.value!r}: {'; '.join(refused)}" if refused else None)
            return impl
        refused.append(f"{impl.spec.backend.value!r} refuses the call ({why})")
    return None


def _chain_call(op: str, impls: List[Implementation]) -> Callable[..., Any]:
    """The per-call path through ``impls`` in order: the first that takes the call runs it. Backends
    after the first one that refuses nothing are never reached, and are dropped."""
    impls = _through_first_unrestricted(impls)
    first = impls[0]
    if len(impls) == 1 and not first.spec.restricted:
        return lambda *args: first.run(*args)

    def chained(*args: Any) -> Any:
        impl = _taker(op, impls, args)
        if impl is not None:
            return impl.run(*args)
        reasons = "; ".join(f"{i.spec.backend.value}: {i.refuses(args)}" for i in impls)
        raise KernelUnavailableError(
            f"deepinfer::{op}: no selected backend takes this call ({reasons})"
            + (f"; {ENV_STRICT} forbids a fallback" if selection().strict else ""))

    # The common case, the first backend restricting dtypes only: one set lookup before the kernel,
    # measured 0.3 µs against 1.5 for the general loop.
    first.load()
    if first.check is not None or first.dtypes is None:
        return chained
    dtypes, data_arg = first.dtypes, first.data_arg

    def fast(*args: Any) -> Any:
        if args[data_arg].dtype in dtypes:
            return first.run(*args)
        return chained(*args)
    return fast


_slots: Dict[str, OpSlot] = {}
_references: Dict[str, "ReferenceSlot"] = {}
_on_new_selection: List[Callable[[], None]] = []


class ReferenceSlot:
    """What the entry of every device but CUDA calls: ``slot.call(*args)``, the torch reference
    itself; while a trace path is set, the reference behind a hook that traces the first use on each
    device type (``op|torch``), as :class:`OpSlot` traces the CUDA key's backends."""

    def __init__(self, op: str, fn: Callable[..., Any], data_arg: int = 0) -> None:
        self.op, self.fn, self.data_arg = op, fn, data_arg
        self.seen: set = set()
        self.call: Callable[..., Any] = fn

    def reset(self) -> None:
        self.seen = set()
        self.call = self._tracing if selection().trace_path else self.fn

    def _tracing(self, *args: Any) -> Any:
        # is_cpu first: 0.05 us against 0.29 for device.type (tracing on: 0.19 us a call over the reference)
        if not (args[self.data_arg].is_cpu and "cpu" in self.seen):
            self._first_use(args)
        return self.fn(*args)

    def _first_use(self, args: tuple) -> None:
        device = _device_type(args[self.data_arg])
        if device not in self.seen:
            with _lock:
                if device not in self.seen:
                    _trace(self.op, Backend.TORCH, args, device)
                    self.seen.add(device)


def reference_slot(op: str, fn: Callable[..., Any], data_arg: int = 0) -> ReferenceSlot:
    """The slot through which every device but CUDA calls the reference ``fn`` of ``op``
    (``library.py`` asks for every op)."""
    with _lock:
        if op not in _references:
            _references[op] = ReferenceSlot(op, fn, data_arg)
            _references[op].reset()
        return _references[op]


def slot(op: str, data_arg: int = 0) -> OpSlot:
    """The slot of ``op`` (created on first request; ``library.py`` asks for every op)."""
    with _lock:
        if op not in _slots:
            _slots[op] = OpSlot(op, data_arg)
        return _slots[op]


def on_new_selection(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever the selection changes (:func:`configure`, :func:`set_platform`), after
    every slot has been reset: how a layer above drops what it chose under the previous selection
    (``library.py`` registers the C++ entry's ``fast_path.clear``)."""
    with _lock:
        _on_new_selection.append(fn)


_tuned: Optional[list] = None  # [table or None] once looked up (auto only)


def tuned_table(on: Optional[Platform] = None):
    """The tuning table ``DEEPINFER_OPS_BACKEND=auto`` dispatches by (``tuning.find``), looked up once
    per selection; the notices of files ignored, or of there being none, are printed then."""
    global _tuned
    with _lock:
        if _tuned is None:
            from .. import tuning

            table, notices = tuning.find(on or platform())
            for n in notices:
                _notice(n + ("" if table else f"; {ENV_BACKEND}={AUTO}: the platform default serves every op "
                                                 "(python -m torch_kernels tune measures this GPU)"))
            _tuned = [table]
        return _tuned[0]


def _reset() -> None:
    global _tuned
    _tuned = None
    for s in _slots.values():
        s.reset()
    for r in _references.values():
        r.reset()
    for fn in _on_new_selection:
        fn()
