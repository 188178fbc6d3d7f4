"""Compile routes: the route each op takes under ``torch.compile``, the notice when it is not the one
asked for, and the cache tag that keeps graphs compiled under other routes apart."""

from __future__ import annotations

from typing import Optional, Tuple

from .. import registry
from ..spec import Backend, Platform
from .planning import plan
from .settings import _notice, selection

_route_notices: set = set()


def compile_route(op: str, device_type: str = "cuda", on: Optional[Platform] = None,
                  after_pointwise: bool = False) -> Tuple[str, Optional[str]]:
    """The route ``op`` takes when ``torch.compile`` traces it on ``device_type`` (``library.py``
    applies it), and the notice for when it is not the route asked for.

    The route asked for is the one forced for this op, else for every op, else
    ``registry.COMPILE_ROUTE``, except that an op of ``registry.DECOMPOSE_AFTER_POINTWISE`` whose data
    input the graph computes with a pointwise op (``after_pointwise``, found by ``library.py``)
    decomposes unless a route is forced. An op that cannot take a route forced for every op keeps its own.
    ``inductor_triton`` launches our Triton kernel, so it needs CUDA and Triton first in
    :func:`plan`: on CUDA with another backend selected the op stays an opaque call to that backend;
    on other devices it decomposes (the reference is what runs there anyway), and the ops of
    ``registry.OPAQUE_OFF_CUDA`` stay opaque there whatever the route.
    """
    asked = selection().forced_route(op)
    if asked is None:
        asked = registry.DECOMPOSE if after_pointwise and op in registry.DECOMPOSE_AFTER_POINTWISE else registry.COMPILE_ROUTE[op]
    route, notice = asked, None
    if (op, asked) in registry.NO_COMPILE_ROUTE:
        route = registry.COMPILE_ROUTE[op]
        notice = f"op {op!r} compiled as {route!r}, not {asked!r}: {registry.NO_COMPILE_ROUTE[op, asked]}"
    if device_type != "cuda":
        if op in registry.OPAQUE_OFF_CUDA:
            return registry.OPAQUE, notice
        return (registry.DECOMPOSE if route == registry.INDUCTOR_TRITON else route), notice
    if route == registry.INDUCTOR_TRITON:
        chain, _ = plan(op, on)
        if not chain or chain[0].backend is not Backend.TRITON:
            served = chain[0].backend.value if chain else "nothing"
            route = registry.OPAQUE
            notice = f"op {op!r} compiled as {route!r}, not {asked!r}: the CUDA key selects {served!r}, not 'triton'"
    return route, notice


_CACHE_TAG = "deepinfer-compile-route:"


def _tag_compile_caches(routes: Tuple[Tuple[str, str], ...]) -> None:
    """torch.compile's caches (AOTAutograd's, Inductor's FX graph cache) key on the Dynamo graph, in
    which an op is one node whatever its route; so forced routes are appended to
    ``torch.compiler.config.cache_key_tag`` (after the user's own tag), and a graph compiled under
    other routes is not reused from the cache."""
    import torch.compiler.config as compiler_config

    own = compiler_config.cache_key_tag.split(_CACHE_TAG)[0]
    compiler_config.cache_key_tag = own + (_CACHE_TAG + ",".join(f"{op}={r}" for op, r in routes) if routes else "")


def note_compile_route(notice: Optional[str]) -> None:
    """Print ``notice`` the first time it arises in this process (per :func:`configure`)."""
    if notice and notice not in _route_notices:
        _route_notices.add(notice)
        _notice(notice)
