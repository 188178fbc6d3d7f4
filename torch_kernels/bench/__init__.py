"""The benchmark suite and the tuner behind ``python -m torch_kernels bench`` and ``tune``.

They ship with the package because ``tune`` writes the tables ``DEEPINFER_OPS_BACKEND=auto`` reads
(``torch_kernels/tuning.py``). Nothing here is imported by ``import torch_kernels``. The per-family
scripts and sweeps stay in ``benchmarks/`` of the source checkout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

#: The folder above the package: the repository root in a source checkout, site-packages otherwise.
PARENT = Path(__file__).resolve().parent.parent.parent


def source_checkout() -> Optional[Path]:
    """The source checkout the package is imported from (an editable install or the repository
    itself), or ``None`` for an installed wheel: there, ``docs/`` and ``benchmarks/`` do not exist."""
    return PARENT if (PARENT / "pyproject.toml").is_file() and (PARENT / "docs").is_dir() else None


def default_out(kind: str) -> Path:
    """Where ``bench`` (``kind="suite"``) and ``tune`` write their measurements by default:
    ``docs/benchmarks/<kind>`` of a source checkout, else ``torch_kernels_bench/<kind>`` in the
    working directory."""
    root = source_checkout()
    return root / "docs" / "benchmarks" / kind if root else Path.cwd() / "torch_kernels_bench" / kind
