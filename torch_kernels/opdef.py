"""What every family builds its ops from: the :class:`OpDef` record with its benchmark case
(:class:`BenchCase`, :class:`Peer`, :class:`HostGoal`), and the comparison against the reference that
an op's ``compare`` (and the tests, through ``testing``) uses.

Here, not in ``ops/__init__.py``, so that a family imports it without importing the package that
imports the families; and not in ``testing.py``, which imports the ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Tuple, Union

import torch

NAMESPACE = "deepinfer"


def _same(x):
    return x


@dataclass(frozen=True)
class Peer:
    """Another implementation an op is timed against: ``fn(*prepare(args))`` is timed; ``prepare`` runs
    once, outside the timed region; ``adapt`` maps its outputs to the reference's conventions for the
    check; ``compare(got, want, dtype)``, where given, replaces the op's own comparison. ``name`` is
    the row's label (and, for a peer of :attr:`BenchCase.peers`, its ``--backends`` key)."""

    name: str
    fn: Callable
    prepare: Callable[[tuple], tuple] = _same
    adapt: Callable[[list], list] = _same
    compare: Optional[Callable[[list, list, torch.dtype], None]] = None


@dataclass(frozen=True)
class HostGoal:
    """A goal on host µs per eager call on CUDA: the op at ``(tokens, hidden)`` in ``dtype``, with
    ``backend`` selected, no slower than the peer of :attr:`BenchCase.peers` named ``peer``."""

    tokens: int
    hidden: Optional[int]
    dtype: str  # a torch dtype's name, as the results write it ("bfloat16")
    peer: str
    backend: str


@dataclass(frozen=True)
class BenchCase:
    """How ``python -m torch_kernels bench`` and ``tune`` run an op. ``profile`` is a shape set's name:
    ``"gpu"`` (a CUDA GPU) or ``"cpu"`` (a smoke run of seconds); the family keys its own sizes by it."""

    # shape(tokens, hidden, profile) -> (rows, hidden, label); hidden is None for an op without one
    shape: Callable[[int, Optional[int], str], Tuple[int, Optional[int], str]]
    # args(rows, hidden, profile, device, dtype): fresh random arguments (never zeros); dtype is the
    # data dtype asked for, which an op whose kernels take one dtype only may ignore
    args: Callable[..., tuple]
    nbytes: Callable[[tuple], int]  # bytes one call on args reads and writes at the least (each tensor once)
    takes_hidden: bool = False  # swept over the profile's hidden sizes (or those --shapes gives)
    # own_hidden(given, profile): the hidden sizes of an op with its own (given: those --shapes names
    # with a token count, maybe none); None with takes_hidden False: an op without a hidden size
    own_hidden: Optional[Callable[[Tuple[int, ...], str], Tuple[int, ...]]] = None
    memory_bound: bool = False  # time is bytes over bandwidth: the "0.95 of copy" goal applies
    # flashinfer(args): FlashInfer's own API for the call, or a string saying why there is none
    flashinfer: Optional[Callable[[tuple], Union[Peer, str]]] = None
    peers: Tuple[Peer, ...] = ()  # other peers, timed at every shape
    # compare(got, want, dtype, args): the check at benchmark shapes where OpDef.compare is not enough;
    # raises AssertionError, or returns None or a note (the row's check reads "ok (note)")
    compare: Optional[Callable[[list, list, torch.dtype, tuple], Optional[str]]] = None
    cpu_default: bool = False  # in the CPU profile's default set
    axis: str = "tokens"  # what a shape's rows count (the plots' x axis)
    host_goal: Optional[HostGoal] = None


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
    # check_draw(args, outputs): the outputs of a backend that draws from its own random stream
    # (KernelSpec.own_random_stream) against what the op may return on args; raises AssertionError
    check_draw: Optional[Callable[[tuple, Any], None]] = None
    bench: Optional[BenchCase] = None  # the benchmark's shapes, bytes and peers; None: not benchmarked
    # other public functions over this op, exported beside its wrapper (FlashInfer's names for its forms)
    aliases: Tuple[Callable[..., Any], ...] = ()

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def out_names(self) -> Tuple[str, ...]:
        """The keyword arguments of the op's ``out`` overload (aten's convention): ``out`` for one
        returned tensor, ``out0, out1, ...`` for several; none for an op that returns nothing."""
        returns = self.schema.split(") -> ", 1)[1]
        if not returns.strip("()"):
            return ()
        count = len(returns.strip("()").split(","))
        return ("out",) if count == 1 else tuple(f"out{i}" for i in range(count))

    @property
    def out_schema(self) -> Optional[str]:
        """``name.out(<args>, *, Tensor(a!) out) -> Tensor(a!)`` (one written output a returned tensor,
        its alias letter one the arguments do not use), or ``None`` where :attr:`out_names` is empty."""
        names = self.out_names
        if not names:
            return None
        args = self.schema.split(") -> ", 1)[0][len(self.name) + 1:]
        letters = [c for c in "abcdefghijklmnop" if f"Tensor({c}" not in args][:len(names)]
        outs = ", ".join(f"Tensor({letters[i]}!) {n}" for i, n in enumerate(names))
        returns = ", ".join(f"Tensor({letters[i]}!)" for i in range(len(names)))
        return f"{self.name}.out({args}, *, {outs}) -> {returns if len(names) == 1 else f'({returns})'}"


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
