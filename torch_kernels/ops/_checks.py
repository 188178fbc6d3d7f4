"""Input checks shared by the op definitions. Every error names the op and the argument."""

import torch
from torch import Tensor

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fail(op: str, arg: str, message: str, exc: type = ValueError):
    raise exc(f"deepinfer::{op}: argument '{arg}' {message}")


def tensor(op: str, arg: str, t) -> None:
    if not isinstance(t, Tensor):
        fail(op, arg, f"must be a Tensor, got {type(t).__name__}", TypeError)


def floating(op: str, arg: str, t: Tensor) -> None:
    if t.dtype not in _FLOATING:
        fail(op, arg, f"must be float16, bfloat16, float32 or float64, got {t.dtype}", TypeError)


def last_dim_contiguous(op: str, arg: str, t: Tensor) -> None:
    if t.dim() == 0:
        fail(op, arg, "must have at least one dimension")
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        fail(op, arg, f"must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def same_device(op: str, arg: str, t: Tensor, ref_arg: str, ref: Tensor) -> None:
    if t.device != ref.device:
        fail(op, arg, f"is on {t.device} but '{ref_arg}' is on {ref.device}")
