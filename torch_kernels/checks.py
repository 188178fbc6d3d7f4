"""Input checks shared by the op definitions. Every error names the op and the argument.

Checks on sizes go through :func:`require`, which is a plain ``if`` in eager mode and
``torch._check_with`` on symbolic sizes, so that the fake functions trace with unbacked token counts
(``torch._dynamo.mark_unbacked``) as well as backed ones, without specialising on them.
"""

from typing import Optional

import torch
from torch import Tensor

FLOATING = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))

# configure(check_indices=), pushed down by selection: True or False for every op that checks an index
# argument (positions, slots) on the data, None for each op's default
_index_checks = [None]


def ask_index_checks(asked: Optional[bool]) -> None:
    """Selection's ``check_indices`` (``dispatch.configure`` sets it on every configure)."""
    _index_checks[0] = asked


def index_check_runs(t: Tensor, default: bool) -> bool:
    """Whether an eager call checks index tensor ``t`` against its table on the data: as
    ``configure(check_indices=)`` asks, else as the op's ``default`` says; never inside a CUDA graph
    capture (the read back would break it)."""
    asked = _index_checks[0]
    runs = (default if asked is None else asked) and not (t.is_cuda and torch.cuda.is_current_stream_capturing())
    _index_checks_run[0] += runs
    return runs


_index_checks_run = [0]


def index_checks_run() -> int:
    """How many index checks have run: a call during which one ran is not one the C++ entry may repeat
    without it."""
    return _index_checks_run[0]


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


def heads(op: str, arg: str, x: Tensor, head_size: int) -> None:
    """``x`` is ``(T, H*head_size)`` or ``(T, H, head_size)`` with H >= 1, last dim contiguous (the
    query and key of the rotary ops)."""
    require(x.dim() in (2, 3), op, arg,
            lambda: f"must be 2-D (num_tokens, num_heads * head_size) or 3-D (num_tokens, num_heads, head_size), got shape {tuple(x.shape)}")
    last_dim_contiguous(op, arg, x)
    if x.dim() == 3:
        require(x.shape[2] == head_size, op, arg,
                lambda: f"must have a last dimension of head_size={head_size}, got shape {tuple(x.shape)}")
        require(x.shape[1] >= 1, op, arg, lambda: f"must have at least one head, got shape {tuple(x.shape)}")
    else:
        require(x.shape[1] % head_size == 0, op, arg,
                lambda: f"must have a width that is a multiple of head_size={head_size}, got shape {tuple(x.shape)}")
        require(x.shape[1] >= head_size, op, arg,
                lambda: f"must have at least one head of head_size={head_size}, got shape {tuple(x.shape)}")


def same_shape(op: str, arg: str, t: Tensor, ref_arg: str, ref: Tensor) -> None:
    msg = lambda: f"must have the shape of '{ref_arg}' {tuple(ref.shape)}, got {tuple(t.shape)}"  # noqa: E731
    require(t.dim() == ref.dim(), op, arg, msg)
    for a, b in zip(t.shape, ref.shape):
        require(a == b, op, arg, msg)


def same_device(op: str, arg: str, t: Tensor, ref_arg: str, ref: Tensor) -> None:
    if t.device != ref.device:
        fail(op, arg, f"is on {t.device} but '{ref_arg}' is on {ref.device}")


def residual(op: str, residual: Tensor, input: Tensor) -> None:
    """A fused-add norm's ``residual``: a tensor of ``input``'s shape, dtype and device, last dimension
    contiguous, and not ``input`` itself."""
    tensor(op, "residual", residual)
    same_shape(op, "residual", residual, "input", input)
    if residual.dtype != input.dtype:
        fail(op, "residual", f"must have the dtype of 'input' ({input.dtype}), got {residual.dtype}", TypeError)
    last_dim_contiguous(op, "residual", residual)
    same_device(op, "residual", residual, "input", input)
    if residual is input:
        fail(op, "residual", "must not be the same tensor as 'input'")


# ----------------------------------------------------------------------------------------------
# Memory overlap of the arguments an op writes. Exact for every strided layout: a tensor is read as
# runs of contiguous bytes (its last dimensions merged) repeated along its other dimensions, so two
# column slices of one fused qkv buffer, which interleave without sharing an element, pass.


def _is_symbolic(t: Tensor) -> bool:
    """A fake or meta tensor, or any without a data pointer: overlap is read from its storage and offsets."""
    if t.is_meta or isinstance(t, torch._subclasses.FakeTensor):
        return True
    try:
        t.data_ptr()
    except RuntimeError:
        return True
    return False


def _concrete(values) -> Optional[list]:
    """Ints for sizes and strides, symbolic ones by their hint (no guard); ``None`` when one has none."""
    out = []
    for v in values:
        if isinstance(v, torch.SymInt):
            # the node's own hint (torch 2.11 lacks symbolic_shapes.has_guarding_hint); reading it adds no guard
            if not v.node.has_hint():
                return None
            v = v.node.hint
        out.append(int(v))
    return out


def _runs(t: Tensor, symbolic: bool):
    """``(start, run, dims)`` in bytes: ``t`` covers ``[start + o, start + o + run)`` for every offset
    ``o = sum(i_k * stride_k)`` over ``dims = [(size_k, stride_k)]`` (sizes above 1, innermost first).
    ``None`` for an empty tensor, or a symbolic one whose sizes have no hint."""
    meta = _concrete((*t.shape, *t.stride(), t.storage_offset()) if symbolic else (*t.shape, *t.stride()))
    if meta is None:
        return None
    n, isz = t.dim(), t.element_size()
    sizes, strides = meta[:n], meta[n:2 * n]
    if 0 in sizes:
        return None
    start = meta[-1] * isz if symbolic else t.data_ptr()
    run, dims = isz, []
    for size, stride in zip(reversed(sizes), reversed(strides)):
        stride *= isz
        if size == 1:
            continue
        if not dims and stride == run:
            run *= size
        elif dims and stride == dims[-1][0] * dims[-1][1]:
            dims[-1] = (dims[-1][0] * size, dims[-1][1])
        else:
            dims.append((size, stride))
    return start, run, dims


def _offsets(dims) -> Tensor:
    """Every run's offset from the start, sorted (int64, on the CPU; called outside any tracing mode)."""
    off = torch.zeros(1, dtype=torch.int64)
    for size, stride in dims:
        off = (off[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
    return off.sort().values


def _overlaps_itself(runs) -> bool:
    _, run, dims = runs
    if any(stride == 0 for _, stride in dims):
        return True
    extent = run
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if stride < extent:  # not provably apart: look at every run
            from torch.utils._python_dispatch import _disable_current_modes
            with _disable_current_modes():
                off = _offsets(dims)
                return bool((off[1:] - off[:-1] < run).any())
        extent += (size - 1) * stride
    return False


def _overlap(a, b) -> bool:
    """Whether two runs layouts share a byte; ``a``'s runs are apart from each other (it is written)."""
    (sa, la, da), (sb, lb, db) = a, b
    da, db = [d for d in da if d[1]], [d for d in db if d[1]]  # a stride-0 dimension covers no new byte
    if sa + la + sum((n - 1) * s for n, s in da) <= sb or sb + lb + sum((n - 1) * s for n, s in db) <= sa:
        return False
    if len(da) <= 1 and len(db) <= 1 and len({s for _, s in da + db}) <= 1:
        # rows of one stride (column slices of one buffer): row i of a meets row j of b iff m = i - j has
        # d - la < m * stride < d + lb
        stride = (da or db or [(1, 1)])[0][1]
        d, ta, tb = sb - sa, da[0][0] if da else 1, db[0][0] if db else 1
        lo, hi = max((d - la) // stride + 1, 1 - tb), min(-((-(d + lb)) // stride) - 1, ta - 1)
        return lo <= hi
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        oa, ob = _offsets(da) + sa, _offsets(db) + sb
        # the last run of a starting before each run of b ends is the only one that can reach into it
        i = torch.searchsorted(oa, ob + lb) - 1
        return bool(((i >= 0) & (oa[i.clamp(min=0)] + la > ob)).any())


def no_overlap(op: str, args) -> None:
    """Raise ``ValueError`` unless every written argument of ``args`` (``(name, tensor or None,
    written)`` in schema order) has no two elements at one address and shares no byte with another
    argument. Fake and meta tensors are compared by storage; sizes without a hint are not checked."""
    tensors = [(name, t, written) for name, t, written in args if isinstance(t, Tensor)]
    symbolic = any(_is_symbolic(t) for _, t, _ in tensors)
    runs = [_runs(t, symbolic) for _, t, _ in tensors]
    for (name, t, written), r in zip(tensors, runs):
        if written and r is not None and _overlaps_itself(r):
            fail(op, name, "has elements that share memory (an expanded or self-overlapping view) and is written in place")
    for j in range(len(tensors)):
        for i in range(j):
            (a, ta, wa), (b, tb, wb) = tensors[i], tensors[j]
            if not (wa or wb) or runs[i] is None or runs[j] is None:
                continue
            if symbolic and not torch._C._is_alias_of(ta, tb):
                continue
            if _overlap(*((runs[i], runs[j]) if wa else (runs[j], runs[i]))):
                fail(op, b, f"overlaps argument '{a}' in memory")
