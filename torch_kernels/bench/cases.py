"""What the benchmarks share, per op, read from its definition's bench case (``OpDef.bench``, a
:class:`~torch_kernels.opdef.BenchCase`): the inputs at a (tokens, hidden) shape, the bytes one call
moves, and FlashInfer's own API as a peer. ``suite.py`` (``python -m torch_kernels bench``) sweeps them
over a profile's shape set; the per-family ``benchmarks/bench_<family>.py`` scripts of the source
checkout take their byte models and FlashInfer peers from here.

A profile is the shape set of one kind of machine: its token counts and the hidden sizes of the ops
that take the profile's (``BenchCase.takes_hidden``); each family keys its own sizes (heads, experts,
vocabulary, ...) by the profile's name. The CPU profile keeps the structure at sizes that run in seconds.

Imports no kernel framework: a family imports FlashInfer when its peer is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .. import ops
from ..opdef import BenchCase, Peer  # noqa: F401  (Peer: what flashinfer_api returns)

#: What the results say of an op whose definition has no bench case.
NOT_BENCHMARKED = "not benchmarked (no bench case in its definition)"


@dataclass(frozen=True)
class Profile:
    """The shape set of one kind of machine."""

    name: str
    tokens: Tuple[int, ...]  # the token counts of the full set
    quick_tokens: Tuple[int, ...]  # --shapes quick
    hidden: Tuple[int, ...]  # the hidden sizes of the ops that take the profile's; quick takes the first


PROFILES = {
    # decode (1-32), batched decode and chunked prefill (128-2048, where engines spend much of their time), prefill
    "gpu": Profile("gpu", tokens=(1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 16384), quick_tokens=(1, 32, 4096),
                   hidden=(4096, 7168, 8192)),
    # small enough that the whole CPU set (4 ops, reference and op) runs in a few seconds
    "cpu": Profile("cpu", tokens=(1, 16, 256), quick_tokens=(1, 16), hidden=(512,)),
}


class NotBenchmarked(LookupError):
    """The op's definition has no bench case."""


def case(op: str) -> BenchCase:
    """The bench case of ``op``'s definition; :class:`NotBenchmarked` where it has none."""
    bench = ops.BY_NAME[op].bench
    if bench is None:
        raise NotBenchmarked(f"{op}: {NOT_BENCHMARKED}")
    return bench


def benchmarked(op: str) -> bool:
    return ops.BY_NAME[op].bench is not None


def shape_of(op: str, tokens: int, hidden: Optional[int], profile: Profile) -> Tuple[int, Optional[int], str]:
    """(rows, hidden, label) of ``op`` at ``tokens`` (and ``hidden`` for the ops that have one)."""
    return case(op).shape(tokens, hidden, profile.name)


def hidden_sizes(op: str, given: Tuple[int, ...], default: Tuple[int, ...], profile: Profile) -> Tuple[Optional[int], ...]:
    """The hidden sizes ``op`` runs at a token count: ``given`` (those ``--shapes`` names with it) or
    ``default`` (the profile's) for an op that takes the profile's; its own for one that has its own;
    ``(None,)`` for an op without a hidden size."""
    bench = case(op)
    if bench.takes_hidden:
        return tuple(given) or tuple(default)
    if bench.own_hidden is not None:
        return tuple(bench.own_hidden(tuple(given), profile.name))
    return (None,)


def build(op: str, rows: int, hidden: Optional[int], profile: Profile, device, dtype: torch.dtype) -> tuple:
    """Fresh random arguments of ``op`` (never zeros). ``dtype`` is the data dtype; an op whose
    kernels take one dtype only (fp32 router logits, fp32 probabilities) keeps its own."""
    return case(op).args(rows, hidden, profile.name, device, dtype)


def one_token(op: str, device: str, dtype: torch.dtype = torch.bfloat16) -> Tuple[tuple, str]:
    """``(args, label)``: fresh arguments of ``op`` as a decode step calls it, one token at its first hidden
    size (the GPU profile's on CUDA)."""
    profile = PROFILES["gpu" if str(device).startswith("cuda") else "cpu"]
    hidden = hidden_sizes(op, (), profile.hidden[:1], profile)[0]
    rows, hidden, label = shape_of(op, 1, hidden, profile)
    return build(op, rows, hidden, profile, device, dtype), label


def nbytes(op: str, args: tuple) -> int:
    """Bytes one call of ``op`` on ``args`` reads and writes at the least (each tensor once)."""
    return case(op).nbytes(args)


def flashinfer_api(op: str, args: tuple) -> Union[Peer, str]:
    """FlashInfer's own API for ``op`` on ``args``, or why there is none."""
    peer = case(op).flashinfer
    return "no FlashInfer peer in its bench case" if peer is None else peer(args)
