"""The plan: the backends that serve an op on the CUDA key, in order, under the current selection."""

from __future__ import annotations

from typing import List, Optional, Tuple

from .. import registry
from ..spec import KernelSpec, Platform
from .settings import ENV_STRICT, platform, selection


def plan(op: str, on: Optional[Platform] = None) -> Tuple[List[KernelSpec], Optional[str]]:
    """The backends that serve ``op`` on the CUDA key, in order, and the notice for its first use.

    An empty list means every call raises :class:`KernelUnavailableError` (the notice says why).
    """
    on = on or platform()
    sel = selection()
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
