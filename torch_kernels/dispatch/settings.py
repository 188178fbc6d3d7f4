"""The selection's settings: the ``DEEPINFER_*`` variables, :class:`Selection` that holds them, and
the current selection and platform, which every module of ``dispatch`` reads (``control`` sets them)."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any, FrozenSet, List, Mapping, Optional, Tuple

from .. import registry
from ..spec import FRAMEWORK_PACKAGE, Backend, Capability, Platform

ENV_BACKEND = "DEEPINFER_OPS_BACKEND"
ENV_FALLBACK = "DEEPINFER_OPS_FALLBACK"
ENV_STRICT = "DEEPINFER_OPS_STRICT"
ENV_VERBOSE = "DEEPINFER_OPS_VERBOSE"
ENV_TRACE = "DEEPINFER_TRACE_KERNELS"
ENV_TRACE_ARGS = "DEEPINFER_TRACE_KERNEL_ARGS"
ENV_COMPILE_ROUTE = "DEEPINFER_OPS_COMPILE_ROUTE"
ENV_CHECK_INDICES = "DEEPINFER_OPS_CHECK_INDICES"

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
          "compile_route": ENV_COMPILE_ROUTE, "check_indices": ENV_CHECK_INDICES}
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
    # eager calls check index arguments (rope's positions, the KV cache's slots) against their tables on
    # the data: True on every device (a device sync on a GPU, never inside a CUDA graph capture), False
    # never, None each op's default (rope: positions on the CPU; the KV cache: DEEPINFER_CHECK_KV_SLOTS)
    check_indices: Optional[bool] = None
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
            check_indices=parse_check_indices(environ.get(ENV_CHECK_INDICES, "")),
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


def parse_check_indices(text: str) -> Optional[bool]:
    """``DEEPINFER_OPS_CHECK_INDICES``: unset or empty for each op's default, else a boolean word."""
    word = text.strip().lower()
    if not word:
        return None
    if word in ("1", "true", "yes", "on"):
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{ENV_CHECK_INDICES} must be 1 or 0 (or unset for each op's default), got {text!r}")


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
