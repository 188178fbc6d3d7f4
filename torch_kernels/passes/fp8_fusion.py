"""The FP8 fusion pass: a norm or a gated activation followed by an FP8 quantisation, in any graph
Inductor compiles, becomes one of our fused ops, wherever the fused op computes the same numbers.

``install_fp8_fusion()`` adds :data:`FP8_FUSION` to ``torch._inductor.config.post_grad_custom_post_pass``
(after any pass already there). In the post-grad graph (ATen ops, functional: an in-place op is an
``auto_functionalized`` node) it rewrites

* a producer: ``deepinfer.rmsnorm`` / ``gemma_rmsnorm`` / ``fused_add_rmsnorm`` /
  ``gemma_fused_add_rmsnorm`` / ``silu_and_mul``, or the formula they compute written in plain torch
  (which is also what our ops decompose into): ``x.float() * rsqrt(mean(x^2, -1) + eps) * w`` (``w``
  upcast, or ``1 + w.float()`` for Gemma) rounded once to ``x``'s dtype, ``F.rms_norm``, the same on
  ``x.float() + residual.float()`` whose rounded sum is also kept (the fused add), ``F.silu(a) * b``
  on the two halves of one tensor computed in fp32 and rounded once;
* followed by a quantisation: ``deepinfer.scaled_fp8_quant`` (static, or dynamic per token without
  ``scale_ub``), ``deepinfer.per_token_group_quant_fp8`` with eps 1e-10, or in plain torch vLLM's
  ``QuantFP8.forward_native``: per token ``scale = clamp(amax(|y|, -1) / 448, min=1 / (448 * 512))``,
  ``q = fp8(clamp(y.float() * scale.reciprocal(), -448, 448))``; static ``y.float() * (1 / scale)``
  or ``* scale.reciprocal()``; per group ``scale = clamp(amax(|y_g|), min=1e-10) / 448``,
  ``q = fp8(clamp(y_g / scale, -448, 448))``,

into ``deepinfer.<producer>_fp8_quant``. Exactness (what the fused ops compute is torch_kernels/fp8.py):
every rounding the graph asks for is the fused op's (the norm's value rounded to the input dtype
before the quant, the product of the activation rounded once), per token and static multiply by
the reciprocal of the scale where the group quant divides. A per-token scale is ``amax * fp32(1 / 448)``:
``amax * (1 / 448)`` anywhere, and ``amax / 448.0`` on CUDA, where torch multiplies by the reciprocal of
a number it divides by (the CPU divides). A group scale is the IEEE quotient: a division by the number
448 on the CPU only, by a tensor of 448s everywhere. What stays the kernel's own, as it is Inductor's in
the unrewritten graph: the order of the mean's sum and the last ulp of exp.

A fused add whose residual may not be overwritten (a graph input the graph does not write back) adds
it into its input instead where that is a fresh value nothing else reads (fp32 addition commutes).

No rewrite where anything differs: another clamp bound or scale floor, a group eps other than 1e-10,
``x / scale`` per token, a weight multiplied after the rounding (vLLM's RMSNorm.forward_native),
``F.silu(a) * b`` in bf16 (rounded twice), a value of the pattern also used outside it (the bf16
normalised value among them: then both stay as written), a ``fused_add_rmsnorm`` whose overwritten
``input`` is read afterwards or copied back to a graph input (the fused op leaves ``input`` as it was),
arguments our op refuses (its fake function raises).
"""

import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

try:  # torch >= 2.12: the slot takes a tuple of passes
    from torch._inductor.custom_graph_pass import get_custom_graph_passes
except ImportError:
    get_custom_graph_passes = None
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from .. import fp8

aten, prims = torch.ops.aten, torch.ops.prims
_AF = torch.ops.higher_order.auto_functionalized
_AF2 = torch.ops.higher_order.auto_functionalized_v2
_D = torch.ops.deepinfer
F32 = torch.float32
LOW = (torch.float16, torch.bfloat16)
CONVERT = prims.convert_element_type.default
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)

#: our producer op -> the fused op
NORMS = {_D.rmsnorm.default: _D.rmsnorm_fp8_quant.default,
         _D.gemma_rmsnorm.default: _D.gemma_rmsnorm_fp8_quant.default}
FUSED_ADDS = {_D.fused_add_rmsnorm.default: _D.fused_add_rmsnorm_fp8_quant.default,
              _D.gemma_fused_add_rmsnorm.default: _D.gemma_fused_add_rmsnorm_fp8_quant.default}
ACTIVATIONS = {_D.silu_and_mul.default: _D.silu_and_mul_fp8_quant.default}
QUANTS = (_D.scaled_fp8_quant.default, _D.per_token_group_quant_fp8.default)


# ----------------------------------------------------------------------------------------------
# Reading nodes


def _is(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _val(n) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dtype(n) -> Optional[torch.dtype]:
    v = _val(n)
    return None if v is None else v.dtype


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _f32(x: float) -> float:
    """``x`` rounded to fp32: the value a Python number takes against an fp32 tensor."""
    return float(torch.tensor(float(x), dtype=F32))


def _is_number(x, want: float) -> bool:
    return _number(x) and float(x) == want


def _same(a, b) -> bool:
    """Sizes (or shapes) equal for every value of their symbols, without a guard."""
    return len(a) == len(b) and statically_known_true(sym_eq(tuple(a), tuple(b)))


def _bind(node: fx.Node, op=None) -> Optional[dict]:
    """``node``'s arguments by schema name, defaults filled in (``op``: the schema to read, for the
    ``auto_functionalized`` nodes whose kwargs are ``op``'s arguments)."""
    schema = (op or node.target)._schema
    out = {}
    for i, a in enumerate(schema.arguments):
        if op is None and i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        elif op is None:
            return None
    return out


def _arg(n: fx.Node, i: int, name: str, default=None):
    """Argument ``i`` (``name``) of ``n``, positional or keyword, else ``default``."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _unconvert(n, dtype) -> Optional[fx.Node]:
    """The input of ``convert_element_type(input, dtype)``, else ``None``."""
    if _is(n, CONVERT) and n.args[1] == dtype and isinstance(n.args[0], fx.Node):
        return n.args[0]
    return None


def _source(n) -> Optional[fx.Node]:
    """The tensor whose fp32 value ``n`` is: ``n`` itself in fp32, or the fp16/bf16 tensor it upcasts
    (exactly)."""
    inner = _unconvert(n, F32)
    if inner is not None and _dtype(inner) in LOW:
        return inner
    return n if _dtype(n) == F32 else None


def _last_dim(dim, n) -> bool:
    v = _val(n)
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return v is not None and isinstance(dim, int) and dim in (-1, v.dim() - 1)


def _pairs(n: fx.Node):
    """Both orders of a two-operand node's arguments (for commutative ops)."""
    if len(n.args) == 2 and not n.kwargs:
        a, b = n.args
        return ((a, b), (b, a))
    return ()


def _times_inverse_max(n, nodes: Set[fx.Node]) -> Optional[fx.Node]:
    """The ``a`` of ``n = a * fp32(1 / 448)``, the product a dynamic per-token scale is (fp8.dynamic_scale):
    ``a * (1 / 448)`` on every device, and ``a / 448.0`` on CUDA, where torch (eager and Inductor alike)
    multiplies by the reciprocal of a number it divides by; the CPU divides."""
    if _dtype(n) != F32 or n.kwargs or len(getattr(n, "args", ())) != 2:
        return None
    if _is(n, aten.mul.Tensor):
        for a, b in _pairs(n):
            if isinstance(a, fx.Node) and _number(b) and _f32(b) == fp8.INV_FP8_MAX:
                return a
        return None
    if _is(n, aten.div.Tensor) and _is_number(n.args[1], fp8.FP8_MAX):
        v = _val(n.args[0])
        return n.args[0] if v is not None and v.device.type == "cuda" else None
    return None


def _exact_div_by_max(n, nodes: Set[fx.Node]) -> Optional[fx.Node]:
    """The dividend of ``n = a / 448`` when that division is IEEE in eager torch on the graph's device."""
    if not _is(n, aten.div.Tensor) or n.kwargs or len(n.args) != 2 or _dtype(n) != F32:
        return None
    a, b = n.args
    device = _val(a).device if _val(a) is not None else None
    if _is_number(b, fp8.FP8_MAX):
        # torch's CUDA kernel multiplies by the reciprocal of a scalar divisor; its CPU one divides
        return a if device is not None and device.type == "cpu" else None
    if _is(b, aten.full.default) and _is_number(b.args[1], fp8.FP8_MAX) and _dtype(b) == F32 \
            and _val(b).device == device:
        if len(b.users) == 1:
            nodes.add(b)
        return a
    return None


@dataclass
class _Part:
    """A matched half of a pattern (the quantisation, or the producer)."""
    nodes: Set[fx.Node] = field(default_factory=set)     # computed only for the pattern: removed
    adapters: Set[fx.Node] = field(default_factory=set)  # upcasts and slices of its inputs: removed if unused
    outputs: Dict[fx.Node, Tuple[int, bool]] = field(default_factory=dict)  # node -> (fused output, unsqueeze(-1))


# ----------------------------------------------------------------------------------------------
# The quantisation


@dataclass
class _Quant(_Part):
    y: Optional[fx.Node] = None       # the quantised tensor, in the dtype of the producer's input
    scale: Optional[fx.Node] = None   # static per-tensor scale
    group_size: int = fp8.PER_TOKEN
    column_major: bool = False
    ue8m0: bool = False


def _our_quant(node: fx.Node) -> Optional[_Quant]:
    a = _bind(node)
    if a is None or not isinstance(a["input"], fx.Node):
        return None
    if node.target is _D.scaled_fp8_quant.default:
        if a["scale_ub"] is not None or a["scale"] is None and not a["per_token"]:
            return None  # no fused op bounds the scale, or takes one amax for the whole tensor
        q = _Quant(y=a["input"], scale=a["scale"])
    else:
        if _f32(a["eps"]) != _f32(fp8.GROUP_EPS):
            return None
        q = _Quant(y=a["input"], group_size=a["group_size"], column_major=a["column_major_scales"],
                   ue8m0=a["scale_ue8m0"])
    if not all(_is(u, operator.getitem) for u in node.users):
        return None
    q.nodes = {node, *node.users}
    q.outputs = {u: (u.args[1], False) for u in node.users}
    return q


def _clamp_fp8(n, nodes: Set[fx.Node]) -> Optional[fx.Node]:
    """The input of ``clamp(x, -448, 448)`` in any of its post-grad spellings."""
    lo, hi = -fp8.FP8_MAX, fp8.FP8_MAX
    if _is(n, aten.clamp.default) and len(n.args) == 3 and _is_number(n.args[1], lo) and _is_number(n.args[2], hi):
        nodes.add(n)
        return n.args[0]
    for outer, outer_bound, inner, inner_bound in ((aten.clamp_max.default, hi, aten.clamp_min.default, lo),
                                                   (aten.clamp_min.default, lo, aten.clamp_max.default, hi)):
        if _is(n, outer) and _is_number(n.args[1], outer_bound):
            m = n.args[0]
            if _is(m, inner) and _is_number(m.args[1], inner_bound):
                nodes.update((n, m))
                return m.args[0]
    return None


def _row_amax_of(n, nodes: Set[fx.Node]) -> Optional[fx.Node]:
    """``t`` where ``n`` is the fp32 max of ``|t|`` over the last dim, kept as ``(..., 1)``: ``amax``
    with keepdim, or ``max(dim).values`` unsqueezed, upcast before or after (both exact)."""
    unsqueezed = False
    while True:
        inner = _unconvert(n, F32)
        if inner is not None and _dtype(inner) in LOW + (F32,):
            nodes.add(n)
            n = inner
        elif _is(n, aten.unsqueeze.default) and not unsqueezed and _last_dim(n.args[1], n):
            nodes.add(n)
            unsqueezed, n = True, n.args[0]
        else:
            break
    if _is(n, aten.amax.default):
        keepdim, dims, src = _arg(n, 2, "keepdim", False), _arg(n, 1, "dim", []), n.args[0]
        nodes.add(n)
    elif _is(n, operator.getitem) and n.args[1] == 0 and _is(n.args[0], aten.max.dim) and len(n.args[0].users) == 1:
        mx = n.args[0]
        keepdim, dims, src = _arg(mx, 2, "keepdim", False), _arg(mx, 1, "dim"), mx.args[0]
        nodes.update((n, mx))
    else:
        return None
    if keepdim == unsqueezed or not _last_dim(dims, src) or not _is(src, aten.abs.default):
        return None
    nodes.add(src)
    return src.args[0]


def _token_scale(s, y: fx.Node, nodes: Set[fx.Node]) -> bool:
    """Whether ``s = max(amax(|y|, -1) * fp32(1 / 448), 1 / (448 * 512))``, the scale fp8.dynamic_scale computes."""
    if _is(s, aten.clamp_min.default):
        floor = s.args[1]
    elif _is(s, aten.clamp.default) and (len(s.args) < 3 or s.args[2] is None):
        floor = s.args[1] if len(s.args) > 1 else s.kwargs.get("min")
    else:
        return False
    if not _number(floor) or _f32(floor) != fp8.MIN_SCALE:
        return False
    amax = _times_inverse_max(s.args[0], nodes)
    if amax is None:
        return False
    nodes.update((s, s.args[0]))
    t = _row_amax_of(amax, nodes)
    if t is None or _source(t) is not y and t is not y:
        return False
    if t is not y:
        nodes.add(t)
    return True


def _static_scale(inv, nodes: Set[fx.Node]) -> Optional[fx.Node]:
    """``s`` where ``inv`` is ``s.reciprocal()`` or ``1 / s`` (``reciprocal(s) * 1``) for a one-element fp32 ``s``."""
    n = inv
    if _is(n, aten.mul.Tensor):
        rest = [b for a, b in _pairs(n) if _is_number(a, 1.0)]
        if not rest:
            return None
        nodes.add(n)
        n = rest[0]
    if not _is(n, aten.reciprocal.default):
        return None
    nodes.add(n)
    s = n.args[0]
    v = _val(s)
    return s if v is not None and v.dtype == F32 and v.dim() <= 1 and v.numel() == 1 else None


def _plain_quant(node: fx.Node) -> Optional[_Quant]:
    """The quantisation ending in ``node = convert(..., float8_e4m3fn)``, written in plain torch."""
    src = _unconvert(node, fp8.FP8)
    if src is None:
        return None
    nodes = {node}
    if _is(src, *RESHAPES):  # the group quant's (..., G, size) -> (..., H), before the clamp or after it
        inner = _clamp_fp8(src.args[0], nodes)
        return None if inner is None else _plain_group(node, src, inner, nodes)
    inner = _clamp_fp8(src, nodes)
    if inner is None:
        return None
    if _is(inner, *RESHAPES):
        return _plain_group(node, inner, inner.args[0], nodes)
    if not _is(inner, aten.mul.Tensor):
        return None
    for yq, inv in _pairs(inner):
        y = _source(yq)
        if y is None:
            continue
        found = set(nodes) | {inner} | ({yq} if yq is not y else set())
        if _is(inv, aten.reciprocal.default) and _token_scale(inv.args[0], y, found):
            found.add(inv)
            return _Quant(nodes=found, outputs={node: (0, False), inv.args[0]: (1, False)}, y=y)
        scale = _static_scale(inv, found)
        if scale is not None:
            return _Quant(nodes=found, outputs={node: (0, False)}, y=y, scale=scale)
    return None


def _plain_group(node: fx.Node, back: fx.Node, div, nodes: Set[fx.Node]) -> Optional[_Quant]:
    """``q = fp8(clamp(g / scale)).reshape(x.shape)`` with ``g = x.float().reshape(..., G, size)`` and
    ``scale = clamp(amax(|g|, -1), min=1e-10) / 448``, the formula of fp8.quantize_groups (row-major);
    ``back`` is the reshape to ``x.shape``, ``div`` the division."""
    nodes.add(back)
    if not _is(div, aten.div.Tensor) or div.kwargs or len(div.args) != 2:
        return None
    g, by = div.args
    if not _is(g, *RESHAPES):
        return None
    yq = g.args[0]
    y = _source(yq)
    vq, vg, vback = _val(yq), _val(g), _val(back)
    if y is None or vq is None or vg is None or vback is None or vg.dim() != vq.dim() + 1:
        return None
    size = vg.shape[-1]
    if not isinstance(size, int) or not _same(vg.shape[:-2], vq.shape[:-1]) or not _same(vback.shape, vq.shape):
        return None
    keepdim = not _is(by, aten.unsqueeze.default)
    scale = by if keepdim else by.args[0]
    if not keepdim and not _last_dim(by.args[1], by):
        return None
    clamped = _exact_div_by_max(scale, nodes)
    if not _is(clamped, aten.clamp_min.default) or not _number(clamped.args[1]) \
            or _f32(clamped.args[1]) != _f32(fp8.GROUP_EPS):
        return None
    amax = clamped.args[0]
    if not _is(amax, aten.amax.default) or not _last_dim(_arg(amax, 1, "dim", []), amax.args[0]) \
            or bool(_arg(amax, 2, "keepdim", False)) != keepdim or not _is(amax.args[0], aten.abs.default) \
            or amax.args[0].args[0] is not g:
        return None
    nodes.update((div, g, scale, clamped, amax, amax.args[0]))
    if not keepdim:
        nodes.add(by)
    if yq is not y:
        nodes.add(yq)
    return _Quant(nodes=nodes, outputs={node: (0, False), scale: (1, keepdim)}, y=y, group_size=size)


# ----------------------------------------------------------------------------------------------
# The producer


@dataclass
class _Producer(_Part):
    fused: object = None        # the fused op
    kwargs: dict = field(default_factory=dict)  # its arguments before the quantisation's
    residual: Optional[fx.Node] = None          # the fused add's residual (written)
    functionalize: object = _AF2                # how the fused add's write is expressed


def _our_producer(y: fx.Node) -> Optional[_Producer]:
    if _is(y, *NORMS, *ACTIVATIONS):
        a = _bind(y)
        if a is None or y.target in NORMS and a["weight"] is None:  # the FP8 norms take a weight
            return None
        kwargs = {"input": a["input"]} if y.target in ACTIVATIONS else \
            {"input": a["input"], "weight": a["weight"], "eps": a["eps"]}
        return _Producer(nodes={y}, fused={**NORMS, **ACTIVATIONS}[y.target], kwargs=kwargs)
    if not (_is(y, operator.getitem) and _is(y.args[0], _AF, _AF2) and y.args[0].args[0] in FUSED_ADDS):
        return None
    af = y.args[0]
    op = af.args[0]
    a = _bind(af, op)
    if a is None or a.get("weight") is None:  # the FP8 norms take a weight
        return None
    if af.target is _AF2:
        extra = set(af.kwargs) - {"weight", "eps", "_input_base_index", "_residual_base_index", "_all_bases"}
        bases, i, r = af.kwargs["_all_bases"], af.kwargs["_input_base_index"], af.kwargs["_residual_base_index"]
        if extra or i is None or r is None or i == r:
            return None  # input or residual a view of its base: not rewritten
        x, residual, input_item, residual_item = bases[i], bases[r], 1 + i, 1 + r
    else:
        x, residual, input_item, residual_item = a["input"], a["residual"], 1, 2
    items = list(af.users)
    if y.args[1] != input_item or not all(_is(u, operator.getitem) for u in items) \
            or [u for u in items if u.args[1] == input_item] != [y]:
        return None
    outputs = {u: (2, False) for u in items if u.args[1] == residual_item}
    return _Producer(nodes={af, *items}, outputs=outputs, fused=FUSED_ADDS[op],
                     kwargs={"input": x, "weight": a["weight"], "eps": a["eps"]}, residual=residual,
                     functionalize=af.target)


def _rounded(y: fx.Node, nodes: Set[fx.Node]) -> Optional[fx.Node]:
    """The fp32 value that ``y`` rounds once to its dtype (``y`` itself in fp32)."""
    if _dtype(y) == F32:
        return y
    inner = _unconvert(y, _dtype(y))
    if _dtype(y) in LOW and inner is not None and _dtype(inner) == F32:
        nodes.add(y)
        return inner
    return None


def _weight(wf, hidden, adapters: Set[fx.Node]):
    """``(weight, gemma)`` where ``wf`` is the fp32 weight the norm multiplies by: the weight upcast,
    or ``1 + weight.float()`` (Gemma)."""
    gemma = False
    if _is(wf, aten.add.Tensor) and _dtype(wf) == F32:
        rest = [b for a, b in _pairs(wf) if _is_number(a, 1.0)]
        if not rest or _dtype(rest[0]) != F32:
            return None
        adapters.add(wf)
        wf, gemma = rest[0], True
    w = _unconvert(wf, F32)
    if w is not None and _dtype(w) is not None and _dtype(w).is_floating_point:
        adapters.add(wf)
    elif _dtype(wf) in LOW + (F32,) and not (gemma and _dtype(wf) != F32):
        w = wf
    else:
        return None
    v = _val(w)
    return (w, gemma) if v is not None and v.dim() == 1 and _same(v.shape, (hidden,)) else None


def _norm_core(n, nodes: Set[fx.Node]):
    """``(xf, eps)`` where ``n = xf * rsqrt(mean(xf^2, -1, keepdim) + eps)`` in fp32."""
    if not _is(n, aten.mul.Tensor) or _dtype(n) != F32:
        return None
    for xf, r in _pairs(n):
        if not _is(r, aten.rsqrt.default) or not _is(r.args[0], aten.add.Tensor, aten.add.Scalar):
            continue
        add = r.args[0]
        if add.kwargs or len(add.args) != 2 or not _number(add.args[1]):
            continue
        mean = add.args[0]
        if not _is(mean, aten.mean.dim) or len(mean.args) < 3 or mean.args[2] is not True \
                or mean.kwargs.get("dtype") is not None or not _last_dim(mean.args[1], xf):
            continue
        sq = mean.args[0]
        if not (_is(sq, aten.pow.Tensor_Scalar) and sq.args[0] is xf and _is_number(sq.args[1], 2)
                or _is(sq, aten.mul.Tensor) and sq.args == (xf, xf)):
            continue
        if _dtype(xf) != F32:
            continue
        nodes.update((n, r, add, mean, sq))
        return xf, add.args[1]
    return None


def _formula_norm(y: fx.Node) -> Optional[_Producer]:
    nodes: Set[fx.Node] = set()
    adapters: Set[fx.Node] = set()
    yf = _rounded(y, nodes)
    if yf is None or not _is(yf, aten.mul.Tensor) or _dtype(yf) != F32:
        return None
    dtype = _dtype(y)
    for n, wf in _pairs(yf):
        core_nodes: Set[fx.Node] = set()
        core = _norm_core(n, core_nodes)
        if core is None:
            continue
        xf, eps = core
        hidden = _val(xf).shape[-1]
        w_adapters: Set[fx.Node] = set()
        weight = _weight(wf, hidden, w_adapters)
        if weight is None:
            continue
        w, gemma = weight
        nodes |= core_nodes | {yf}
        adapters |= w_adapters
        fused_add = _fused_add_sum(xf, dtype, nodes, adapters)
        if fused_add is not None:
            x, residual, outputs = fused_add
            op = _D.gemma_fused_add_rmsnorm_fp8_quant.default if gemma else _D.fused_add_rmsnorm_fp8_quant.default
            return _Producer(nodes=nodes, adapters=adapters, outputs=outputs, fused=op, residual=residual,
                             kwargs={"input": x, "weight": w, "eps": float(eps)})
        x = _source(xf)
        if x is None or _dtype(x) != dtype:
            return None
        if x is not xf:
            adapters.add(xf)
        op = _D.gemma_rmsnorm_fp8_quant.default if gemma else _D.rmsnorm_fp8_quant.default
        return _Producer(nodes=nodes, adapters=adapters, fused=op, kwargs={"input": x, "weight": w, "eps": float(eps)})
    return None


def _fused_add_sum(s: fx.Node, dtype, nodes: Set[fx.Node], adapters: Set[fx.Node]):
    """``(input, residual, outputs)`` where ``s = input.float() + residual.float()`` and the graph keeps
    ``s`` rounded to ``dtype`` (the new residual: those nodes become outputs); else ``None``."""
    if not _is(s, aten.add.Tensor) or s.kwargs or len(s.args) != 2 or _dtype(s) != F32:
        return None
    x, r = (_source(a) for a in s.args)
    if x is None or r is None or _dtype(x) != dtype or _dtype(r) != dtype \
            or not _same(_val(x).shape, _val(s).shape) or not _same(_val(r).shape, _val(s).shape):
        return None
    if dtype == F32:
        kept = [s] if any(u not in nodes for u in s.users) else []
    else:
        kept = [u for u in s.users if _unconvert(u, dtype) is s]
    if not kept:
        return None  # the sum is not kept: rmsnorm_fp8_quant cannot take it, and a written residual would be waste
    nodes.update((s, *kept))
    adapters.update(a for a in s.args if a not in (x, r))
    return x, r, {k: (2, False) for k in kept}


def _half(n, adapters: Set[fx.Node]):
    """``(x, 0 or 1)`` where ``n`` is the fp32 value of the first or second half of ``x``'s last dim."""
    src = _unconvert(n, F32)
    if src is not None and _dtype(src) in LOW:
        found = _slice_half(src)
        if found is not None:
            adapters.update((n, src) + found[2])
            return found[:2]
        return None
    if _dtype(n) != F32:
        return None
    found = _slice_half(n)
    if found is None:
        return None
    x, which, more = found
    base = _source(x)
    if base is None:
        return None
    adapters.update((n,) + more + ((x,) if base is not x else ()))
    return base, which


def _slice_half(n):
    """``(x, 0 or 1, extra nodes)`` where ``n`` is one half of ``x`` along its last dim."""
    if _is(n, aten.slice.Tensor):
        x, dim, start, end, step = (list(n.args) + [0, None, None, 1][len(n.args) - 1:])[:5]
        v = _val(x)
        if v is None or not _last_dim(dim, x) or step != 1 or not isinstance(v.shape[-1], int) or v.shape[-1] % 2:
            return None
        half = v.shape[-1] // 2
        start = 0 if start is None else start
        if start == 0 and end == half:
            return x, 0, ()
        if start == half and (end is None or isinstance(end, int) and end >= 2 * half):
            return x, 1, ()
        return None
    if _is(n, operator.getitem) and _is(n.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        sp = n.args[0]
        x, sizes = sp.args[0], sp.args[1]
        dim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
        v = _val(x)
        if v is None or not _last_dim(dim, x) or not isinstance(v.shape[-1], int) or v.shape[-1] % 2:
            return None
        half = v.shape[-1] // 2
        if sizes not in (half, [half, half]) or n.args[1] not in (0, 1):
            return None
        return x, n.args[1], (sp,)
    return None


def _silu(n, nodes: Set[fx.Node]) -> Optional[fx.Node]:
    """``a`` where ``n = silu(a)``: the op, or its decomposition ``a / (1 + exp(-a))``."""
    if _is(n, aten.silu.default):
        nodes.add(n)
        return n.args[0]
    if not _is(n, aten.div.Tensor) or n.kwargs or len(n.args) != 2:
        return None
    a, den = n.args
    if not _is(den, aten.add.Tensor) or den.kwargs:
        return None
    for e, one in _pairs(den):
        if _is_number(one, 1.0) and _is(e, aten.exp.default) and _is(e.args[0], aten.neg.default) \
                and e.args[0].args[0] is a:
            nodes.update((n, den, e, e.args[0]))
            return a
    return None


def _formula_silu(y: fx.Node) -> Optional[_Producer]:
    nodes: Set[fx.Node] = set()
    yf = _rounded(y, nodes)
    if yf is None or not _is(yf, aten.mul.Tensor) or _dtype(yf) != F32:
        return None
    for act, up in _pairs(yf):
        silu_nodes: Set[fx.Node] = set()
        gate = _silu(act, silu_nodes)
        if gate is None or _dtype(gate) != F32:
            continue
        adapters: Set[fx.Node] = set()
        first, second = _half(gate, adapters), _half(up, adapters)
        if first is None or second is None or first[1] != 0 or second[1] != 1 or first[0] is not second[0] \
                or _dtype(first[0]) != _dtype(y):
            continue
        return _Producer(nodes=nodes | silu_nodes | {yf}, adapters=adapters - silu_nodes,
                         fused=_D.silu_and_mul_fp8_quant.default, kwargs={"input": first[0]})
    return None


# ----------------------------------------------------------------------------------------------
# The rewrite


def _fake(fn, *args, **kwargs):
    """``fn`` on the fake values of the nodes among its arguments, in the graph's fake mode."""
    from torch._guards import detect_fake_mode
    from torch.utils import _pytree as pytree

    vals = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (args, kwargs))
    mode = detect_fake_mode([v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return fn(*vals[0], **vals[1])


def _depends_on(n, nodes: Set[fx.Node]) -> bool:
    seen, stack = set(), [n]
    while stack:
        m = stack.pop()
        if not isinstance(m, fx.Node) or m in seen:
            continue
        if m in nodes:
            return True
        seen.add(m)
        stack.extend(m.all_input_nodes)
    return False


def _fresh(n, removed: Set[fx.Node]) -> bool:
    """Whether ``n`` is a tensor of its own (an op's output that aliases none of its arguments, no
    graph input) that nothing outside the pattern ``removed`` reads: the fused add may overwrite it."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    returns = n.target._schema.returns
    return (len(returns) == 1 and returns[0].alias_info is None and isinstance(_val(n), torch.Tensor)
            and all(u in removed for u in n.users))


def _overwritten(prod: _Producer, removed: Set[fx.Node]) -> Tuple[fx.Node, fx.Node, Set[fx.Node]]:
    """``(input, residual, dropped)`` of the fused add: ``h + input`` is ``input + h`` bit for bit
    (fp32 addition commutes), so where the residual ``h`` would have to be copied to be written (a graph
    input the graph does not write back, a value read elsewhere, a clone of ``h``: a caller keeping
    ``h``) and the input is a fresh value read by nothing else, the fused op adds ``h`` into the input
    instead: a copy of the hidden state less, 1.4 µs at 32 tokens of 4096 (the clone: ``dropped``)."""
    x, r = prod.kwargs["input"], prod.residual
    if not _fresh(x, removed) or not isinstance(r, fx.Node) or _val(r) is None \
            or _val(r).dtype != _val(x).dtype or not _same(_val(r).shape, _val(x).shape):
        return x, r, set()
    if _is(r, aten.clone.default) and len(r.args) == 1 and not r.kwargs and all(u in removed for u in r.users):
        h = r.args[0]
        if isinstance(h, fx.Node) and _val(h) is not None and _val(h).dtype == _val(x).dtype \
                and _same(_val(h).shape, _val(x).shape):
            return h, x, {r}
    written_back = r.op == "placeholder" and any(_is(u, aten.copy_.default) and u.args[0] is r for u in r.users)
    if written_back or _fresh(r, removed):
        return x, r, set()
    return r, x, set()


def _rewrite(graph: fx.Graph, quant: _Quant, prod: _Producer) -> bool:
    removed = quant.nodes | prod.nodes
    outputs = {**quant.outputs, **prod.outputs}
    if not outputs:
        return False
    if any(u not in removed for n in removed - set(outputs) for u in n.users):
        return False  # a value of the pattern is used outside it
    if quant.scale is not None and _depends_on(quant.scale, removed):
        return False
    op = prod.fused
    dropped: Set[fx.Node] = set()
    if prod.residual is not None:
        x, residual, dropped = _overwritten(prod, removed)
        prod = _Producer(nodes=prod.nodes, adapters=prod.adapters, outputs=prod.outputs, fused=op,
                         kwargs={**prod.kwargs, "input": x}, residual=residual, functionalize=prod.functionalize)
    kwargs = {**prod.kwargs, "scale": quant.scale, "group_size": quant.group_size,
              "column_major_scales": quant.column_major, "scale_ue8m0": quant.ue8m0}
    if prod.residual is None:
        target, args, call_kwargs = op, tuple(kwargs[a.name] for a in op._schema.arguments), {}
    elif prod.functionalize is _AF2:
        target, args, call_kwargs = _AF2, (op,), {**kwargs, "_residual_base_index": 0, "_all_bases": [prod.residual]}
    else:
        target, args, call_kwargs = _AF, (op,), {**kwargs, "residual": prod.residual}
    try:
        val = _fake(target, *args, **call_kwargs)
    except (RuntimeError, TypeError, ValueError):
        return False  # our op refuses these arguments (its checks run in its fake function)
    if val is None:
        return False
    for old, (i, unsqueeze) in outputs.items():
        want, got = _val(old), val[i]
        if want is None or want.dtype != got.dtype or not _same(want.shape, got.shape + ((1,) if unsqueeze else ())):
            return False
    order = {n: k for k, n in enumerate(graph.nodes)}
    with graph.inserting_before(min(outputs, key=order.__getitem__)):
        fused = graph.call_function(target, args, call_kwargs)
        fused.meta["val"] = val
        items = {}
        for i in sorted({i for i, _ in outputs.values()}):
            items[i] = graph.call_function(operator.getitem, (fused, i))
            items[i].meta["val"] = val[i]
        for old, (i, unsqueeze) in outputs.items():
            new = items[i]
            if unsqueeze:
                new = graph.call_function(aten.unsqueeze.default, (new, -1))
                new.meta["val"] = val[i].unsqueeze(-1)
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in removed)
    for n in sorted(removed | quant.adapters | prod.adapters | dropped, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
    return True


def _producer(y: fx.Node) -> Optional[_Producer]:
    return _our_producer(y) or _formula_norm(y) or _formula_silu(y)


def fuse(graph: fx.Graph) -> List[str]:
    """Rewrite ``graph`` in place; the names of the fused ops it now calls, one per rewrite."""
    done: List[str] = []
    live = set(graph.nodes)
    for node in list(graph.nodes):
        if node not in live or node.op != "call_function":
            continue  # erased by an earlier rewrite
        try:
            quant = _our_quant(node) if node.target in QUANTS else _plain_quant(node) if node.target is CONVERT else None
            prod = _producer(quant.y) if quant is not None and isinstance(quant.y, fx.Node) else None
        except (IndexError, KeyError, AttributeError, TypeError):
            continue  # a spelling of an op the matchers do not read: not this pattern, and never a failed compile
        if prod is not None and _rewrite(graph, quant, prod):
            done.append(prod.fused._schema.name.split("::")[-1])
            live = set(graph.nodes)
    if done:
        stable_topological_sort(graph)  # a static scale may be computed after the first output replaced
    return done


class Fp8FusionPass(CustomGraphPass):
    """The post-grad pass; counts its rewrites in ``torch._dynamo.utils.counters["deepinfer"]``."""

    def __call__(self, graph: fx.Graph) -> None:
        from torch._dynamo.utils import counters

        for name in fuse(graph):
            counters["deepinfer"][f"fp8_fusion:{name}"] += 1

    def uuid(self) -> bytes:
        # the FX graph cache keys on what the pass does: its source and the numerics it relies on
        return get_hash_for_files((__file__, fp8.__file__))


#: the pass object ``install_fp8_fusion`` installs
FP8_FUSION = Fp8FusionPass()


class ChainedPasses(CustomGraphPass):
    """Several passes in one slot, for a torch whose slot takes one (before 2.12, without
    ``get_custom_graph_passes``); cached only if every pass is a ``CustomGraphPass``."""

    def __init__(self, passes):
        self.passes = tuple(passes)

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self):
        ids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        return None if any(i is None for i in ids) else repr(ids).encode()


def custom_passes(slot) -> tuple:
    """The passes a post-grad custom pass slot holds, in the order they run."""
    if get_custom_graph_passes is not None:
        return tuple(get_custom_graph_passes(slot))
    return () if slot is None else slot.passes if isinstance(slot, ChainedPasses) else (slot,)


def as_slot(passes):
    """What to put in a post-grad custom pass slot to run ``passes`` in order."""
    passes = tuple(passes)
    if len(passes) <= 1:
        return passes[0] if passes else None
    return passes if get_custom_graph_passes is not None else ChainedPasses(passes)


def install_fp8_fusion() -> None:
    """Run :data:`FP8_FUSION` in every graph Inductor compiles from now on, after any post-grad custom
    pass already installed (``torch._inductor.config.post_grad_custom_post_pass``). Idempotent.
    Graphs compiled before keep their code (``torch.compiler.reset()`` drops them)."""
    passes = custom_passes(inductor_config.post_grad_custom_post_pass)
    if any(p is FP8_FUSION for p in passes):
        return
    inductor_config.post_grad_custom_post_pass = as_slot((*passes, FP8_FUSION))


def uninstall_fp8_fusion() -> None:
    """Remove :data:`FP8_FUSION` from the post-grad custom passes, leaving the others as they run."""
    passes = custom_passes(inductor_config.post_grad_custom_post_pass)
    inductor_config.post_grad_custom_post_pass = as_slot(p for p in passes if p is not FP8_FUSION)
