"""What every family builds its ops from: the :class:`OpDef` record, and the comparison against the
reference that an op's ``compare`` (and the tests, through ``testing``) uses.

Here, not in ``ops/__init__.py``, so that a family imports it without importing the package that
imports the families; and not in ``testing.py``, which imports the ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Tuple

import torch

NAMESPACE = "deepinfer"


@dataclass(frozen=True)
class OpDef:
    schema: str  # "name(args) -> returns", as torch.library.Library.define takes it
    validate: Callable[..., None]  # raises ValueError/TypeError naming the op and the argument
    fake: Callable[..., Any]  # output metadata from input metadata (meta and fake tensors)
    wrapper: Callable[..., Any]  # the typed public function; its docstring is the op's reference
    samples: Callable[..., Iterator[tuple]]  # samples(device, dtype): fresh random arguments, awkward shapes
    # tokens(n, device) -> (args, token_args): arguments for a batch of n tokens (n may be 0 or 1),
    # and the indices of the arguments whose first dimension is that token count (for recompile tests)
    tokens: Callable[..., Tuple[tuple, Tuple[int, ...]]]
    data_arg: int = 0  # the argument whose dtype a kernel's KernelSpec.dtypes refers to
    backward: Optional[Callable[..., Any]] = None  # torch.library.register_autograd formula
    setup_context: Optional[Callable[..., Any]] = None
    no_grad_reason: Optional[str] = "it has no backward formula"  # ops without `backward` refuse autograd, saying why
    # compare(got, want, dtype): a backend's outputs against the reference's (as
    # testing.outputs_of returns them); raises AssertionError. None: assert_close per output.
    compare: Optional[Callable[..., None]] = None

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"


#: (atol, rtol) per dtype for a backend against the reference. Kernels and the reference both
#: compute in fp32 and round once, so they differ by summation order and by the final rounding:
#: up to 2 ulp of the output dtype (fp16 2^-10, bf16 2^-7 at magnitude 1).
TOLERANCES = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual, expected, dtype=None, msg: str = "") -> None:
    """``torch.testing.assert_close`` with the tolerance of ``dtype`` (default: ``expected``'s)."""
    atol, rtol = TOLERANCES.get(dtype or expected.dtype, (0, 0))  # integer/bool outputs: exact
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True,
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)
