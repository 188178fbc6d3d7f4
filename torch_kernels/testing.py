"""What the tests and the self-check share: the comparison against the reference. The tolerance table
and ``assert_close`` live with the op definitions (``opdef.py``), which compare with them too."""

import inspect

import torch

from . import dispatch, ops, registry
from .library import mutated_args  # noqa: F401  (the tests and the self-check use it from here)
from .opdef import TOLERANCES, assert_close  # noqa: F401  (likewise)
from .spec import Backend


def compare_outputs(opdef, got: list, want: list, dtype) -> None:
    """A backend's outputs against the reference's: the op's own ``compare`` if it has one (FP8,
    integer ids, samples), else :func:`assert_close` with ``dtype``'s tolerance for each output."""
    if opdef.compare is not None:
        opdef.compare(got, want, dtype)
        return
    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
    for g, w in zip(got, want):
        assert_close(g, w, dtype if g.is_floating_point() else None)


def outputs_of(fn, args: tuple, mutated: tuple) -> list:
    """Call ``fn`` on clones of ``args`` (strides kept) and return what it produced: its return
    value(s), then the arguments it mutates."""
    args = tuple(clone_keep_strides(a) if i in mutated else a for i, a in enumerate(args))
    out = fn(*args)
    produced = [] if out is None else list(out) if isinstance(out, (tuple, list)) else [out]
    return produced + [args[i] for i in mutated]


def clone_keep_strides(t):
    """A copy of ``t`` with its strides (``clone`` makes strided rows contiguous)."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def as_dispatched(spec):
    """``spec``'s implementation as the dispatcher runs it: calls it refuses (dtype, per-call check)
    go to the torch reference, as they would go down the backend chain."""
    impl = dispatch.Implementation(spec, ops.BY_NAME[spec.op].data_arg)
    impl.load()
    if not spec.restricted:
        return impl.fn
    fn, reference = impl.fn, registry.BY_OP[spec.op][Backend.TORCH].load()

    signature = inspect.signature(reference)

    def dispatched(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return (reference if impl.refuses(tuple(bound.arguments.values())) is not None else fn)(*args, **kwargs)
    return dispatched
