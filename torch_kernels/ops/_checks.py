"""Input checks shared by the op definitions. Every error names the op and the argument.

Checks on sizes go through :func:`require`, which is a plain ``if`` in eager mode and
``torch._check_with`` on symbolic sizes, so that the fake functions trace with unbacked token counts
(``torch._dynamo.mark_unbacked``) as well as backed ones, without specialising on them.
"""

import torch
from torch import Tensor

FLOATING = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _message(op: str, arg: str, message: str) -> str:
    return f"deepinfer::{op}: argument '{arg}' {message}"


def fail(op: str, arg: str, message: str, exc: type = ValueError):
    raise exc(_message(op, arg, message))


def require(cond, op: str, arg: str, message, exc: type = ValueError) -> None:
    """Raise ``exc`` naming the op and the argument unless ``cond``; ``message`` may be a callable."""
    if cond is True:
        return
    text = lambda: _message(op, arg, message() if callable(message) else message)  # noqa: E731
    if cond is False:
        raise exc(text())
    torch._check_with(exc, cond, text)  # a SymBool: checked when the size is known


def tensor(op: str, arg: str, t) -> None:
    if not isinstance(t, Tensor):
        fail(op, arg, f"must be a Tensor, got {type(t).__name__}", TypeError)


def floating(op: str, arg: str, t: Tensor) -> None:
    if t.dtype not in FLOATING:
        fail(op, arg, f"must be float16, bfloat16, float32 or float64, got {t.dtype}", TypeError)


def last_dim_contiguous(op: str, arg: str, t: Tensor) -> None:
    if t.dim() == 0:
        fail(op, arg, "must have at least one dimension")
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        fail(op, arg, f"must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def same_shape(op: str, arg: str, t: Tensor, ref_arg: str, ref: Tensor) -> None:
    msg = lambda: f"must have the shape of '{ref_arg}' {tuple(ref.shape)}, got {tuple(t.shape)}"  # noqa: E731
    require(t.dim() == ref.dim(), op, arg, msg)
    for a, b in zip(t.shape, ref.shape):
        require(a == b, op, arg, msg)


def same_device(op: str, arg: str, t: Tensor, ref_arg: str, ref: Tensor) -> None:
    if t.device != ref.device:
        fail(op, arg, f"is on {t.device} but '{ref_arg}' is on {ref.device}")
