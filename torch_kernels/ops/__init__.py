"""Op definitions: per op its schema, input validation, fake function, autograd formula and typed
wrapper. ``library.py`` registers every :class:`OpDef` in :data:`ALL`."""

from __future__ import annotations

from typing import Tuple

from . import activation, attention, moe, norm, quant, rope, sampling
from ._opdef import NAMESPACE, OpDef  # noqa: F401  (what library.py and the families use)

ALL: Tuple[OpDef, ...] = (*norm.OPS, *activation.OPS, *rope.OPS, *quant.OPS, *moe.OPS, *attention.OPS, *sampling.OPS)
BY_NAME = {d.name: d for d in ALL}
