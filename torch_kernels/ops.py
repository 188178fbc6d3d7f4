"""The op definitions of every family (``families/<family>/ops.py``): per op its schema, input
validation, fake function, autograd formula and typed wrapper. ``library.py`` registers every
:class:`OpDef` in :data:`ALL`, in the inventory's order."""

from __future__ import annotations

import importlib
from typing import Dict, Tuple

from . import registry
from .opdef import NAMESPACE, OpDef  # noqa: F401  (what library.py uses)


def _definitions() -> Tuple[OpDef, ...]:
    found = {d.name: d for f in registry.FAMILIES for d in importlib.import_module(f.definitions).OPS}
    if found.keys() != set(registry.OPS):
        raise RuntimeError(f"the op definitions and the manifests disagree: defined only {sorted(found.keys() - set(registry.OPS))}, "
                           f"in a manifest only {sorted(set(registry.OPS) - found.keys())}")
    return tuple(found[op] for op in registry.OPS)


ALL: Tuple[OpDef, ...] = _definitions()
BY_NAME: Dict[str, OpDef] = {d.name: d for d in ALL}
