"""Setting the selection: :func:`configure` and :func:`set_platform`, which reset what every module of
``dispatch`` resolved under the previous one."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Dict, Optional

from .. import checks, registry, reporting
from ..spec import Backend, Platform
from . import settings
from .compile_routes import _route_notices, _tag_compile_caches
from .settings import AUTO, ENV_STRICT, Selection, _lock, _notice, parse_compile_route
from .slots import _reset
from .trace import _traced, _unwritable, append_line


def set_platform(p: Optional[Platform]) -> None:
    """Resolve against ``p`` instead of the detected platform (``None``: detect again). For tests."""
    with _lock:
        settings._platform = p
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
    if selection is not None and not isinstance(selection, Selection):
        raise ValueError(f"configure(selection=...) must be a Selection, got {selection!r}; to pick a backend "
                         f"by name: configure(backend={selection!r})")
    base = selection if selection is not None else settings._selection
    changes = _parsed_changes(changes)
    new = dataclasses.replace(base, **changes, env_fields=base.env_fields - set(changes)).validate()
    with _lock:
        previous, settings._selection = settings._selection, new
        reporting.update(new.verbose, functools.partial(append_line, new.trace_path) if new.trace_path else None)
        checks.ask_index_checks(new.check_indices)
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
    if "check_indices" in out and not (out["check_indices"] is None or isinstance(out["check_indices"], bool)):
        raise ValueError(f"configure(check_indices=...) must be True, False or None (each op's default), "
                         f"got {out['check_indices']!r}")
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
