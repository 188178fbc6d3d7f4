"""Selection: which backend serves each op on the CUDA dispatch key.

The semantics of the DeepInfer kernel dispatcher, applied to ops:

* Platform default: per op, the backends of ``registry.cuda_priority(op)`` whose capability is met
  here; the first serves the op, the later ones take the calls it refuses (dtype, size). On every
  other device the torch reference serves (``library.py`` registers it there).
* ``DEEPINFER_OPS_BACKEND=<backend>``: every op from that backend. An op it lacks (no implementation,
  or one this platform cannot run) comes from the platform default: one stderr line at import says
  how many (all names with ``DEEPINFER_OPS_VERBOSE=1``), and one line at the first *use* of each
  such op names it.
* ``DEEPINFER_OPS_BACKEND=auto``: every call of an op from the backend measured fastest for its shape
  bucket on this GPU (``tuning.py``, ``python -m torch_kernels tune``), the platform default's order
  behind it; with no usable table for this GPU the platform default serves, and one line says why.
* ``DEEPINFER_OPS_FALLBACK=op,op``: those ops come from the platform default even when another backend
  is selected. A name that is not an op, or that the selected backend does not implement, raises.
* ``DEEPINFER_OPS_STRICT=1``: no fallback of any kind. The default backend is never imported; an op
  the selected backend lacks, or a call it refuses, raises :class:`KernelUnavailableError`. STRICT
  with FALLBACK raises.
* ``DEEPINFER_TRACE_KERNELS=path``: the first use of each (op, backend) on each device type appends a
  line ``op|backend`` to ``path`` (the reference serving CPU included: :class:`ReferenceSlot`);
  ``DEEPINFER_TRACE_KERNEL_ARGS=1`` adds the argument signature (never tensor data). A path that
  cannot be written gives one notice and traces nothing more; an op call never raises for it.
* ``DEEPINFER_OPS_COMPILE_ROUTE=route`` or ``op=route,...`` (both: ``opaque,rmsnorm=decompose``): the
  route under ``torch.compile`` (``registry.COMPILE_ROUTES``) for every op, or for the ops named,
  instead of each op's measured ``registry.COMPILE_ROUTE``; see :func:`compile_route`.

:func:`configure` does all of it from Python. A misconfiguration raises ``ValueError`` naming the
variable, or the argument of :func:`configure` (``configure(backend=...)``) that set it. Resolution happens on the first CUDA call of an op,
under a lock (the first calls from several threads select and load once), not at import: reading
the compute capability initialises CUDA, and engines fork their workers after importing us.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import os
import sys
import threading
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple

from . import registry, reporting
from .spec import FRAMEWORK_PACKAGE, Backend, Capability, KernelSpec, Platform

ENV_BACKEND = "DEEPINFER_OPS_BACKEND"
ENV_FALLBACK = "DEEPINFER_OPS_FALLBACK"
ENV_STRICT = "DEEPINFER_OPS_STRICT"
ENV_VERBOSE = "DEEPINFER_OPS_VERBOSE"
ENV_TRACE = "DEEPINFER_TRACE_KERNELS"
ENV_TRACE_ARGS = "DEEPINFER_TRACE_KERNEL_ARGS"
ENV_COMPILE_ROUTE = "DEEPINFER_OPS_COMPILE_ROUTE"

_FALSE = ("", "0", "false", "no", "off")
AUTO = "auto"


class KernelUnavailableError(AttributeError):
    """The selected backend lacks this op, or cannot take this call, and STRICT forbids a fallback.

    An ``AttributeError`` as in the DeepInfer dispatcher, so ``hasattr``-style probing keeps
    working; ``tests/conftest.py`` turns it into a skip.
    """


#: the variable that sets each field of :class:`Selection`
ENV_OF = {"backend": ENV_BACKEND, "auto": ENV_BACKEND, "fallback": ENV_FALLBACK, "strict": ENV_STRICT,
          "verbose": ENV_VERBOSE, "trace_path": ENV_TRACE, "trace_args": ENV_TRACE_ARGS,
          "compile_route": ENV_COMPILE_ROUTE}
#: what ``pip install`` takes for each backend's framework, where it is not the import name
_PIP_NAME = {"flashinfer": "flashinfer-python"}


@dataclasses.dataclass(frozen=True)
class Selection:
    """The selection controls; :meth:`from_env` reads them from the ``DEEPINFER_*`` variables."""

    backend: Optional[Backend] = None  # None: the platform default
    fallback: FrozenSet[str] = frozenset()
    strict: bool = False
    verbose: bool = False
    trace_path: Optional[str] = None
    trace_args: bool = False
    # forced compiled routes: sorted (op, route) pairs, op "*" for every op; () keeps COMPILE_ROUTE
    compile_route: Tuple[Tuple[str, str], ...] = ()
    auto: bool = False  # DEEPINFER_OPS_BACKEND=auto: per call, the measured winner (tuning.py)
    # the fields read from the environment (errors name their variable), the others set by configure()
    env_fields: FrozenSet[str] = dataclasses.field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Selection":
        backend = environ.get(ENV_BACKEND, "").strip()
        auto = backend.lower() == AUTO
        try:
            parsed = Backend.parse(backend) if backend and not auto else None
        except ValueError as e:
            raise ValueError(f"{ENV_BACKEND}: {e}") from None
        return cls(
            backend=parsed,
            auto=auto,
            fallback=frozenset(n.strip() for n in environ.get(ENV_FALLBACK, "").split(",") if n.strip()),
            strict=environ.get(ENV_STRICT, "").strip().lower() not in _FALSE,
            verbose=environ.get(ENV_VERBOSE, "").strip().lower() not in _FALSE,
            trace_path=environ.get(ENV_TRACE) or None,
            trace_args=environ.get(ENV_TRACE_ARGS, "").strip().lower() not in _FALSE,
            compile_route=parse_compile_route(environ.get(ENV_COMPILE_ROUTE, "")),
            env_fields=frozenset(ENV_OF),
        )

    def name_of(self, field: str) -> str:
        """What set ``field``, as an error names it: its variable, or ``configure(field=...)``."""
        return ENV_OF[field] if field in self.env_fields else f"configure({field}=...)"

    def validate(self) -> "Selection":
        """This selection, or a ``ValueError`` naming the variable or argument that is wrong."""
        name = self.name_of
        if self.auto and (self.backend is not None or self.strict):
            auto = f"{ENV_BACKEND}={AUTO}" if "auto" in self.env_fields else f"configure(backend={AUTO!r})"
            other = name("strict") if self.strict else name("backend")
            raise ValueError(f"{auto} chooses among the usable backends per call: it cannot be combined with {other}")
        if self.strict and self.fallback:
            raise ValueError(f"{name('strict')} forbids {name('fallback')}: strict means no fallback of any kind")
        unknown = sorted(self.fallback - set(registry.OPS))
        if unknown:
            raise ValueError(f"{name('fallback')} names unknown op(s) {unknown}; the ops are: {', '.join(registry.OPS)}")
        for op, route in self.compile_route:
            if route not in registry.COMPILE_ROUTES:
                raise ValueError(f"{name('compile_route')} names unknown route {route!r}; the routes are: "
                                 f"{', '.join(registry.COMPILE_ROUTES)}")
            if op != "*" and op not in registry.COMPILE_ROUTE:
                raise ValueError(f"{name('compile_route')} names unknown op {op!r}; the ops are: {', '.join(registry.OPS)}")
            if (op, route) in registry.NO_COMPILE_ROUTE:
                raise ValueError(f"{name('compile_route')}: op {op!r} cannot take route {route!r}: "
                                 f"{registry.NO_COMPILE_ROUTE[op, route]}")
        if self.backend is not None:
            unimplemented = sorted(n for n in self.fallback if self.backend not in registry.BY_OP[n])
            if unimplemented:
                raise ValueError(f"{name('fallback')} names op(s) backend {self.backend.value!r} does not implement: "
                                 f"{unimplemented}")
        return self

    def forced_route(self, op: str) -> Optional[str]:
        """The route forced for ``op`` (by name, else for every op), or ``None``."""
        routes = dict(self.compile_route)
        return routes.get(op, routes.get("*"))

    def lacking(self) -> List[str]:
        """Ops the selected backend lacks, as far as is known without touching the GPU: no
        implementation, or its framework is not installed. FALLBACK ops are not counted."""
        if self.backend is None:
            return []
        out = []
        for op in registry.OPS:
            spec = registry.BY_OP[op].get(self.backend)
            if op not in self.fallback and (spec is None or spec.capability.missing_package()):
                out.append(op)
        return out

    def not_installed(self) -> Optional[str]:
        """``pip install <package>`` when the selected backend's framework is not installed, else ``None``."""
        if self.backend is None or self.backend is Backend.TORCH:
            return None
        package = FRAMEWORK_PACKAGE[self.backend]
        if Capability(package=package).missing_package() is None:
            return None
        return f"pip install {_PIP_NAME.get(package, package)}"


_lock = threading.RLock()
_selection = Selection()
_platform: Optional[Platform] = None
_traced: set = set()  # (op, backend, device type) traced since the last configure()
_unwritable: set = set()  # trace paths that failed once: never tried again until configure()
_route_notices: set = set()
_tuned: Optional[list] = None  # [table or None] once looked up (auto only)


def _notice(message: str) -> None:
    print(f"[deepinfer] {message}", file=sys.stderr, flush=True)


def selection() -> Selection:
    return _selection


def platform() -> Platform:
    """The platform selection resolves against (detected on first need, or set by :func:`set_platform`)."""
    global _platform
    if _platform is None:
        _platform = Platform.detect()
    return _platform


def tuned_table(on: Optional[Platform] = None):
    """The tuning table ``DEEPINFER_OPS_BACKEND=auto`` dispatches by (``tuning.find``), looked up once
    per selection; the notices of files ignored, or of there being none, are printed then."""
    global _tuned
    with _lock:
        if _tuned is None:
            from . import tuning

            table, notices = tuning.find(on or platform())
            for n in notices:
                _notice(n + ("" if table else f"; {ENV_BACKEND}={AUTO}: the platform default serves every op "
                                                 "(python -m torch_kernels tune measures this GPU)"))
            _tuned = [table]
        return _tuned[0]


def set_platform(p: Optional[Platform]) -> None:
    """Resolve against ``p`` instead of the detected platform (``None``: detect again). For tests."""
    global _platform
    with _lock:
        _platform = p
        _reset()


def configure(selection: Optional[Selection] = None, **changes: Any) -> Selection:
    """Set the selection from Python, as the environment variables do; returns the previous one.

    ``configure(backend="triton", strict=True)``, ``configure(Selection.from_env())``. Backend
    names are parsed, fallback may be any iterable of op names (or one string, comma-separated),
    compile_route a string as ``DEEPINFER_OPS_COMPILE_ROUTE`` takes or a mapping ``{op: route}``
    (``None``: the measured routes). A bad argument raises ``ValueError`` naming it
    (``configure(backend=...)``), and nothing changes. Every op resolves again on its next call, and
    the summary line is printed as at import. A changed compile route applies to graphs compiled
    afterwards (``torch.compiler.reset()`` drops the ones compiled before).
    """
    global _selection
    if selection is not None and not isinstance(selection, Selection):
        raise ValueError(f"configure(selection=...) must be a Selection, got {selection!r}; to pick a backend "
                         f"by name: configure(backend={selection!r})")
    base = selection if selection is not None else _selection
    changes = _parsed_changes(changes)
    new = dataclasses.replace(base, **changes, env_fields=base.env_fields - set(changes)).validate()
    with _lock:
        previous, _selection = _selection, new
        reporting.update(new.verbose, functools.partial(append_line, new.trace_path) if new.trace_path else None)
        _reset()
        _traced.clear()
        _route_notices.clear()
        _unwritable.clear()
        if new.compile_route != previous.compile_route:
            _tag_compile_caches(new.compile_route)
    _summarise(new)
    return previous


_BOOLS = ("strict", "verbose", "trace_args", "auto")


def _parsed_changes(changes: Dict[str, Any]) -> Dict[str, Any]:
    """``configure``'s keyword arguments as :class:`Selection` fields; ``ValueError`` naming a bad one."""
    fields = [f.name for f in dataclasses.fields(Selection) if f.name != "env_fields"]
    unknown = sorted(set(changes) - set(fields))
    if unknown:
        raise ValueError(f"configure() takes no argument {unknown[0]!r}; it takes: {', '.join(fields)}")
    out = dict(changes)
    if "backend" in out:
        value = out["backend"]
        if value is not None and not isinstance(value, str):
            raise ValueError(f"configure(backend=...) must be a backend name, {AUTO!r} or None, got {value!r}")
        named_auto = isinstance(value, str) and value.strip().lower() == AUTO
        out["auto"] = named_auto or bool(changes.get("auto", False))  # auto=True with a backend: refused below
        try:
            out["backend"] = Backend.parse(value) if isinstance(value, str) and not named_auto else None
        except ValueError as e:
            raise ValueError(f"configure(backend=...): {e}") from None
    if "fallback" in out:
        value = out["fallback"] or ()
        names = value.split(",") if isinstance(value, str) else value
        try:
            names = [n.strip() for n in names if not isinstance(n, str) or n.strip()]
        except (TypeError, AttributeError):
            raise ValueError(f"configure(fallback=...) must be op names (an iterable, or one string "
                             f"'op,op'), got {value!r}") from None
        out["fallback"] = frozenset(names)
    for name in _BOOLS:
        if name in out and out[name] not in (True, False):
            raise ValueError(f"configure({name}=...) must be True or False, got {out[name]!r}")
        if name in out:
            out[name] = bool(out[name])
    if "trace_path" in out:
        value = out["trace_path"]
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ValueError(f"configure(trace_path=...) must be a path or None, got {value!r}")
        out["trace_path"] = os.fspath(value) if value else None
        if isinstance(out["trace_path"], bytes):
            out["trace_path"] = os.fsdecode(out["trace_path"])
    if "compile_route" in out:
        try:
            out["compile_route"] = parse_compile_route(out["compile_route"])
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"configure(compile_route=...) must be a string ('route' or 'op=route,...'), a "
                             f"mapping {{op: route}} or None, got {out['compile_route']!r}") from None
    return out


def _summarise(sel: Selection) -> None:
    """The one line at import (or configure) on the ops the selected backend lacks."""
    lacking = sel.lacking()
    if not lacking:
        return
    backend, install = sel.backend.value, sel.not_installed()
    if install and sel.strict:
        _notice(f"backend {backend!r} is not installed ({install}); {ENV_STRICT} is set, so calling any op "
                "raises KernelUnavailableError")
    elif install:
        _notice(f"backend {backend!r} is not installed ({install}): all {len(registry.OPS)} ops from the "
                "platform default")
    elif sel.strict:
        names = lacking if sel.verbose else f"first: {lacking[0]}"
        _notice(f"backend {backend!r} lacks {len(lacking)} op(s); {ENV_STRICT} is set, "
                f"so calling them raises KernelUnavailableError ({names})")
    else:
        names = lacking if sel.verbose else f"first: {lacking[0]}"
        _notice(f"backend {backend!r} lacks {len(lacking)} op(s), falling back to the "
                f"platform default ({names})")


def plan(op: str, on: Optional[Platform] = None) -> Tuple[List[KernelSpec], Optional[str]]:
    """The backends that serve ``op`` on the CUDA key, in order, and the notice for its first use.

    An empty list means every call raises :class:`KernelUnavailableError` (the notice says why).
    """
    on = on or platform()
    sel = _selection
    default = [k for k in registry.implementations(op) if k.is_available(on)]
    if sel.backend is None or op in sel.fallback:
        return (default[:1] if sel.strict else default), None
    spec = registry.BY_OP[op].get(sel.backend)
    why = f"{sel.backend.value!r} does not implement it" if spec is None else None
    if spec is not None and not spec.is_available(on):
        why = f"{sel.backend.value!r} cannot run here: {spec.unavailable_reason(on)}"
    if why is None:
        return ([spec] if sel.strict else [spec] + [k for k in default if k is not spec]), None
    if sel.strict:
        return [], f"{why} and {ENV_STRICT} forbids a fallback"
    return default, f"op {op!r} used from {default[0].backend.value!r}: {why}"


def parse_compile_route(spec: Any) -> Tuple[Tuple[str, str], ...]:
    """``"opaque,rmsnorm=decompose"`` (a bare route applies to every op; ``op=route`` to one), a
    mapping ``{op: route}`` or ``None``, as sorted ``(op, route)`` pairs with op ``"*"`` for all."""
    if not spec:
        return ()
    if isinstance(spec, str):
        items = {}
        for item in filter(None, (i.strip() for i in spec.split(","))):
            op, named, route = item.rpartition("=")
            items[op if named else "*"] = route
        spec = items
    pairs = {str(op).strip(): str(route).strip().lower() for op, route in dict(spec).items()}
    return tuple(sorted(pairs.items()))


def compile_route(op: str, device_type: str = "cuda", on: Optional[Platform] = None,
                  after_pointwise: bool = False) -> Tuple[str, Optional[str]]:
    """The route ``op`` takes when ``torch.compile`` traces it on ``device_type`` (``library.py``
    applies it), and the notice for when it is not the route asked for.

    The route asked for is the one forced for this op, else for every op, else
    ``registry.COMPILE_ROUTE``, except that an op of ``registry.DECOMPOSE_AFTER_POINTWISE`` whose data
    input the graph computes with a pointwise op (``after_pointwise``, found by ``library.py``)
    decomposes unless a route is forced. An op that cannot take a route forced for every op keeps its own.
    ``inductor_triton`` launches our Triton kernel, so it needs CUDA and Triton first in
    :func:`plan`: on CUDA with another backend selected the op stays an opaque call to that backend;
    on other devices it decomposes (the reference is what runs there anyway), and the ops of
    ``registry.OPAQUE_OFF_CUDA`` stay opaque there whatever the route.
    """
    asked = _selection.forced_route(op)
    if asked is None:
        asked = registry.DECOMPOSE if after_pointwise and op in registry.DECOMPOSE_AFTER_POINTWISE else registry.COMPILE_ROUTE[op]
    route, notice = asked, None
    if (op, asked) in registry.NO_COMPILE_ROUTE:
        route = registry.COMPILE_ROUTE[op]
        notice = f"op {op!r} compiled as {route!r}, not {asked!r}: {registry.NO_COMPILE_ROUTE[op, asked]}"
    if device_type != "cuda":
        if op in registry.OPAQUE_OFF_CUDA:
            return registry.OPAQUE, notice
        return (registry.DECOMPOSE if route == registry.INDUCTOR_TRITON else route), notice
    if route == registry.INDUCTOR_TRITON:
        chain, _ = plan(op, on)
        if not chain or chain[0].backend is not Backend.TRITON:
            served = chain[0].backend.value if chain else "nothing"
            route = registry.OPAQUE
            notice = f"op {op!r} compiled as {route!r}, not {asked!r}: the CUDA key selects {served!r}, not 'triton'"
    return route, notice


_CACHE_TAG = "deepinfer-compile-route:"


def _tag_compile_caches(routes: Tuple[Tuple[str, str], ...]) -> None:
    """torch.compile's caches (AOTAutograd's, Inductor's FX graph cache) key on the Dynamo graph, in
    which an op is one node whatever its route; so forced routes are appended to
    ``torch.compiler.config.cache_key_tag`` (after the user's own tag), and a graph compiled under
    other routes is not reused from the cache."""
    import torch.compiler.config as compiler_config

    own = compiler_config.cache_key_tag.split(_CACHE_TAG)[0]
    compiler_config.cache_key_tag = own + (_CACHE_TAG + ",".join(f"{op}={r}" for op, r in routes) if routes else "")


def note_compile_route(notice: Optional[str]) -> None:
    """Print ``notice`` the first time it arises in this process (per :func:`configure`)."""
    if notice and notice not in _route_notices:
        _route_notices.add(notice)
        _notice(notice)


class _Impl:
    """One backend's implementation of one op, loaded on first use."""

    __slots__ = ("op", "spec", "fn", "check", "dtypes", "data_arg", "notice", "run", "started")

    def __init__(self, spec: KernelSpec, data_arg: int, notice: Optional[str]) -> None:
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
        self.impls: List[_Impl] = []
        self.call: Callable[..., Any] = self._resolve_and_call

    def reset(self) -> None:
        self.impls = []
        self.call = self._resolve_and_call

    def _resolve_and_call(self, *args: Any) -> Any:
        with _lock:
            if self.call == self._resolve_and_call:
                chain, notice = plan(self.op)
                self.impls = [_Impl(k, self.data_arg, notice if i == 0 else None) for i, k in enumerate(chain)]
                auto = self._auto() if _selection.auto and chain else None
                if auto is not None:
                    self.call = auto
                elif not chain:
                    self.call = self._unavailable(notice)
                elif len(chain) == 1 and not chain[0].restricted:
                    self.call = self._single
                else:
                    self.call = _chain_call(self.op, self.impls)
        return self.call(*args)

    def sole_server(self, args: tuple) -> Optional[KernelSpec]:
        """The implementation that serves every call of this data dtype, as far as its first call has
        shown (no per-call check beyond the dtype, not ``auto``), or ``None``: what ``fast_path.offer``
        may publish."""
        first = self.impls[0] if self.impls and not _selection.auto else None
        if first is None or not first.started or first.check is not None:
            return None
        return first.spec if first.dtypes is None or args[self.data_arg].dtype in first.dtypes else None

    def _auto(self) -> Optional[Callable[..., Any]]:
        """Under ``auto``: each call to the chain of its bucket's measured winner (the winner first, then
        the platform default's order), or ``None`` when the table has nothing for this op."""
        from . import tuning

        table = tuned_table()
        if table is None:
            return None
        op = self.op
        chains = {i.spec.backend: (_chain_call(op, [i] + [j for j in self.impls if j is not i]), i.direct)
                  for i in self.impls}

        def trace(backend: str, bucket: str) -> None:
            if _selection.trace_path:
                append_line(_selection.trace_path, f"{op}|{backend}|auto {bucket}")
        return tuning.auto_call(table, op, self.data_arg, chains, _chain_call(op, self.impls), trace)

    def _unavailable(self, why: Optional[str]) -> Callable[..., Any]:
        def raise_unavailable(*args: Any) -> Any:
            raise KernelUnavailableError(f"deepinfer::{self.op}: {why}")
        return raise_unavailable

    def _single(self, *args: Any) -> Any:
        impl = self.impls[0]
        out = impl.run(*args)
        self.call = impl.fn  # from now on the backend function itself: no per-call cost here
        return out


def _chain_call(op: str, impls: List[_Impl]) -> Callable[..., Any]:
    """The per-call path through ``impls`` in order: the first that takes the call runs it. Backends
    after the first one that refuses nothing are never reached, and are dropped."""
    unrestricted = [n for n, i in enumerate(impls) if not i.spec.restricted]
    impls = impls[:unrestricted[0] + 1] if unrestricted else impls
    first = impls[0]
    if len(impls) == 1 and not first.spec.restricted:
        return lambda *args: first.run(*args)

    def chained(*args: Any) -> Any:
        refused = []
        for impl in impls:
            why = impl.refuses(args)
            if why is None:
                if not impl.started:  # a fallback's first call says so, once (under the lock)
                    impl._started(args, f"op {op!r} served by {impl.spec.backend.value!r}: {'; '.join(refused)}" if refused else None)
                return impl.run(*args)
            refused.append(f"{impl.spec.backend.value!r} refuses the call ({why})")
        reasons = "; ".join(f"{i.spec.backend.value}: {i.refuses(args)}" for i in impls)
        raise KernelUnavailableError(
            f"deepinfer::{op}: no selected backend takes this call ({reasons})"
            + (f"; {ENV_STRICT} forbids a fallback" if _selection.strict else ""))

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
        self.call = self._tracing if _selection.trace_path else self.fn

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


def _reset() -> None:
    global _tuned
    _tuned = None
    for s in _slots.values():
        s.reset()
    for r in _references.values():
        r.reset()
    for fn in _on_new_selection:
        fn()


def _describe(a: Any) -> str:
    """An argument as the trace shows it: shapes, dtypes, strides and scalars, never tensor data."""
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        text = f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}@{a.device}"
        return text if a.is_contiguous() else f"{text}stride={list(a.stride())}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_describe(x) for x in a) + "]"
    return repr(a)


def _device_type(a: Any) -> str:
    device = getattr(a, "device", None)
    return getattr(device, "type", "cpu")


def _trace(op: str, backend: Backend, args: tuple, device: str) -> None:
    """The trace line of the first use of (op, backend) on ``device`` (a device type)."""
    path = _selection.trace_path
    if not path or (op, backend, device) in _traced:
        return
    _traced.add((op, backend, device))
    line = f"{op}|{backend.value}"
    if _selection.trace_args:
        line += "|args=(" + ", ".join(_describe(a) for a in args) + ")"
    append_line(path, line)


def append_line(path: str, line: str) -> bool:
    """Append one line with one ``write`` on an ``O_APPEND`` descriptor under an exclusive lock, so
    that the ranks of a data-parallel job sharing one trace file never interleave a line.

    Never raises: a path that cannot be written (missing directory, a directory, no permission, a
    FIFO nobody reads) gives one notice and is not tried again until :func:`configure`; False then."""
    if path in _unwritable:
        return False
    data = (line.rstrip("\n") + "\n").encode()
    try:
        # O_NONBLOCK: a FIFO with no reader fails at once (ENXIO) instead of hanging the op call
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)  # closing releases the lock
    except (OSError, ValueError) as e:
        with _lock:
            if path not in _unwritable:
                _unwritable.add(path)
                name = _selection.name_of("trace_path") if path == _selection.trace_path else "the trace"
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                why += " (a FIFO with no reader)" if getattr(e, "errno", None) == errno.ENXIO else ""
                _notice(f"{name}: cannot append to {path!r} ({why}); nothing more is traced there")
        return False
    return True


configure(Selection.from_env())
