"""FlashInfer gated activations: ``(..., 2d) -> (..., d)``, ``act(x[..., :d]) * x[..., d:]`` in fp32,
rounded once, through ``flashinfer.activation.silu_and_mul`` / ``gelu_and_mul`` (erf: our
``approximate="none"``) / ``gelu_tanh_and_mul`` (``approximate="tanh"``), each ``(input, out=None,
enable_pdl=None)`` in 0.6.0-0.7.4 and each its own JIT module (``<act>_and_mul``).

Calls the kernel cannot take go to the next backend (``<op>_refuses``; fp16/bf16 only through
``KernelSpec.dtypes``, the kernel's ``DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16``):

* strided rows: the kernel finds row ``t`` at ``t * 2d`` elements;
* loads: 0.7.4 loads the widest of 8/4/2/1 elements dividing ``d``, so the input must sit on that many
  elements; earlier releases always load 16 bytes (from the up half too, ``d`` elements in), and launch
  ``d / 8`` threads, so they need ``d % 8 == 0`` and a 16-byte aligned input (``d = 4`` faults there);
* more than 2^31 - 1 rows (one block a row).
"""

from typing import Optional

import flashinfer.activation as fi_activation
import torch
from torch import Tensor

from ... import outputs
from ...backends import flashinfer_jit as _module

#: The first release whose launcher narrows its loads to a width dividing d (earlier: d % 8 == 0).
_NARROW_LOADS = (0, 7, 4)
_MAX_ROWS = 2**31 - 1


def _load_width(d: int) -> Optional[int]:
    """Elements per load for ``d``, or ``None`` when this FlashInfer cannot take ``d``."""
    if _module.VERSION >= _NARROW_LOADS:
        return next(w for w in (8, 4, 2, 1) if d % w == 0)
    return 8 if d % 8 == 0 else None


def _refuses(input: Tensor) -> Optional[str]:
    if not input.is_contiguous():
        return "strided rows: FlashInfer's act_and_mul reads row t at t * 2d"
    d = input.shape[-1] // 2
    width = _load_width(d)
    if width is None:
        return f"d = {d} is not a multiple of 8: FlashInfer {_module.VERSION_TEXT} loads 16 bytes at a time"
    if input.data_ptr() % (width * input.element_size()):
        return f"input is not {width * input.element_size()}-byte aligned (FlashInfer loads {width} elements at a time)"
    if input.numel() // input.shape[-1] > _MAX_ROWS:
        return f"more than {_MAX_ROWS} rows (FlashInfer launches one block a row)"
    return None


def _act_and_mul(input: Tensor, act: str, out=None) -> Tensor:
    shape = (*input.shape[:-1], input.shape[-1] // 2)
    y = None if out is None else outputs.given(out, 0, shape, input.dtype, input.device)
    if input.numel() == 0:  # zero rows: a grid of 0 blocks is a launch error
        return torch.empty(shape, dtype=input.dtype, device=input.device) if y is None else y
    name = f"{act}_and_mul"
    _module.jit_module(name, fi_activation.gen_act_and_mul_module, fi_activation.get_act_and_mul_module, act)
    return getattr(fi_activation, name)(input, out=y)


def silu_and_mul(input: Tensor, *, out=None) -> Tensor:
    return _act_and_mul(input, "silu", out)


def gelu_and_mul(input: Tensor, approximate: str = "none", *, out=None) -> Tensor:
    return _act_and_mul(input, "gelu_tanh" if approximate == "tanh" else "gelu", out)


def gelu_tanh_and_mul(input: Tensor, *, out=None) -> Tensor:
    return _act_and_mul(input, "gelu_tanh", out)


def silu_and_mul_refuses(input: Tensor) -> Optional[str]:
    return _refuses(input)


def gelu_and_mul_refuses(input: Tensor, approximate: str = "none") -> Optional[str]:
    return _refuses(input)


def gelu_tanh_and_mul_refuses(input: Tensor) -> Optional[str]:
    return _refuses(input)
