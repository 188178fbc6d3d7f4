"""The outputs a backend's ``host`` publishes for the C++ entry (``spec.HostKernels.outputs``), by kind of op.

Kept apart from the kernel modules it serves, so that the fingerprints of kernels that never publish
(``fingerprints.py``: the text of the modules a kernel imports) do not change with it.
"""

import torch

from ..fp8 import PER_TOKEN


def fp8_outputs(hidden: int, static: bool, group_size: int, column_major: bool) -> tuple:
    """q and the scales as ``fp8.empty_outputs`` lays them (``spec.OUTPUT_LAYOUTS``): a quantising op's."""
    if static:
        scales = ("one", torch.float32, 1)
    elif group_size == PER_TOKEN:
        scales = ("token", torch.float32, 1)
    else:
        scales = ("column" if column_major else "rows", torch.float32, hidden // group_size)
    return ("rows", torch.float8_e4m3fn, hidden), scales
