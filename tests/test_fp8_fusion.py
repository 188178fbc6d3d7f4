"""The FP8 fusion pass (``torch_kernels.passes``): which graphs it rewrites into our fused ops, that
the rewritten graph computes the same bits as the graph it replaced, and which graphs it leaves alone.

Each pattern is compiled three ways on fresh random input: with the pass, without it, and eagerly;
q (as bytes), the scales and the residual must be equal in all three. Without the pass, Inductor is
told to keep the roundings to bf16 the code asks for (``emulate_precision_casts``): by default it
drops the one between a norm and the quant it fuses, which the pass's fused op keeps, so the
unrewritten compiled graph would differ from both eager and the rewrite. The goldens list the
post-grad graph's call_function targets (getitems left out) after the pass. On CUDA (``gpu``) our
pairs are compared the same way; the plain patterns against the fused op (rsqrt and exp differ there
in the last ulp between ATen, Inductor and our kernels).
"""

import functools
import operator
import re

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import torch_kernels  # noqa: F401  (registers torch.ops.deepinfer)
from torch_kernels import fp8, passes
from torch_kernels.passes import fp8_fusion

d = torch.ops.deepinfer
BF16 = torch.bfloat16
FP8 = fp8.FP8
T, H, GROUP = 8, 256, 64


# ----------------------------------------------------------------------------------------------
# Compiling and reading the post-grad graph


def _name(target) -> str:
    return str(target).removesuffix(".default")


def _targets(graph) -> str:
    """The call_function targets of ``graph`` in order, one a line, getitems left out."""
    names = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        t = n.target
        names.append(f"{t.name()}({_name(n.args[0])})" if isinstance(t, torch._ops.HigherOrderOperator) else _name(t))
    return "\n".join(names)


def _calls(targets: str) -> set:
    """The ops named in ``targets`` (an ``auto_functionalized`` node's op among them)."""
    return set(re.split(r"[\s()]+", targets)) - {""}


class _Capture(CustomGraphPass):
    """Records the post-grad graph's targets; ``stop``: then ends the compile (a graph nobody runs
    need not be compiled to C++)."""

    def __init__(self, stop=False):
        self.targets, self.stop = None, stop

    def __call__(self, graph):
        graph.lint()
        self.targets = _targets(graph)
        if self.stop:
            raise _Captured

    def uuid(self):
        return None  # never from the FX graph cache: the pass must run


class _Captured(Exception):
    pass


def _compile(fn, args, fusion=True, emulate=False, stop=False, dynamic=None):
    """``(outputs, targets)`` of ``fn`` compiled by Inductor with the pass (``fusion``), without it, or
    with the passes installed now (``fusion=None``); ``outputs`` None with ``stop``."""
    torch._dynamo.reset()
    capture = _Capture(stop)
    installed = fp8_fusion.custom_passes(inductor_config.post_grad_custom_post_pass)
    custom = (*installed, capture) if fusion is None else (passes.FP8_FUSION, capture) if fusion else (capture,)
    with inductor_config.patch(post_grad_custom_post_pass=fp8_fusion.as_slot(custom), emulate_precision_casts=emulate):
        try:
            out = torch.compile(fn, fullgraph=True, dynamic=dynamic)(*args)
        except Exception:
            if capture.targets is None or not stop:
                raise
            out = None
    return out, capture.targets


def _targets_of(fn, *args) -> str:
    return _compile(fn, args, stop=True)[1]


def _bits(out):
    """Every tensor of ``out`` comparable with ``torch.equal``: fp8 as its bytes."""
    flat = out if isinstance(out, (tuple, list)) else (out,)
    return [t.view(torch.uint8) if t.dtype == FP8 else t for t in flat]


def _assert_equal(got, want, what):
    for i, (g, w) in enumerate(zip(_bits(got), _bits(want))):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}, output {i}: {g.dtype} {g.shape} vs {w.dtype} {w.shape}"
        assert torch.equal(g, w), f"{what}, output {i}: {int((g != w).sum())} of {g.numel()} values differ"


# ----------------------------------------------------------------------------------------------
# Inputs


def _random(*shape, dtype=BF16, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def _exact_rows(*shape, dtype=BF16, device="cpu"):
    """Nonzero multiples of 1/4 up to 7/4: every sum of their squares is exact in fp32, in any order,
    so the mean square (hidden size a power of two) is the same whichever kernel reduces it."""
    mag = torch.randint(1, 8, shape, device=device).float() / 4
    sign = torch.randint(0, 2, shape, device=device).float() * 2 - 1
    return (mag * sign).to(dtype)


def _gate_up(*shape, dtype=BF16, device="cpu"):
    """``(..., 2d)``: gates in [17, 33), where ``exp(-g) < 2^-24`` makes ``silu(g) = g`` in fp32 whatever
    the last ulp of exp (ATen's and Inductor's may differ), then random up values."""
    gate = 17 + 16 * torch.rand(*shape[:-1], shape[-1] // 2, device=device)
    up = torch.randn(*shape[:-1], shape[-1] // 2, device=device)
    return torch.cat([gate, up], -1).to(dtype)


def _scale(device="cpu"):
    return torch.rand((), device=device) * 0.03 + 0.02  # fp32, positive: most |y| / scale below 448


def _weight(device="cpu", dtype=BF16):
    return _random(H, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------
# The patterns: our ops, then plain torch. Each is (fn, inputs(device)).


def _quant(kind, y, s=None):
    if kind == "per_token":
        return d.scaled_fp8_quant(y, None, True)
    if kind == "static":
        return d.scaled_fp8_quant(y, s)
    if kind == "group":
        return d.per_token_group_quant_fp8(y, GROUP)
    assert kind == "group_cm_ue8m0"
    return d.per_token_group_quant_fp8(y, 128, 1e-10, True, True)


def _ours(producer, kind):
    static = kind == "static"
    if producer in ("rmsnorm", "gemma_rmsnorm"):
        norm = getattr(d, producer)

        def fn(x, w, *s):
            return _quant(kind, norm(x, w, 1e-5), *s)
        return fn, lambda dev: (_random(T, H, device=dev), _weight(dev)) + ((_scale(dev),) if static else ())
    if producer in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm"):
        norm = getattr(d, producer)

        def fn(h, wo, residual, w, *s):
            x = h @ wo  # the attention's output projection: the norm's input is no graph input
            norm(x, residual, w, 1e-6)
            return (*_quant(kind, x, *s), residual)
        return fn, lambda dev: (_random(T, 64, device=dev), _random(64, H, device=dev) / 8, _random(T, H, device=dev),
                                _weight(dev)) + ((_scale(dev),) if static else ())
    assert producer == "silu_and_mul"

    def fn(x, *s):
        return _quant(kind, d.silu_and_mul(x), *s)
    return fn, lambda dev: (_random(T, 2 * H, device=dev),) + ((_scale(dev),) if static else ())


OURS = [("rmsnorm", "per_token"), ("rmsnorm", "static"), ("rmsnorm", "group"), ("rmsnorm", "group_cm_ue8m0"),
        ("gemma_rmsnorm", "per_token"), ("fused_add_rmsnorm", "per_token"), ("fused_add_rmsnorm", "static"),
        ("fused_add_rmsnorm", "group"), ("gemma_fused_add_rmsnorm", "group"), ("silu_and_mul", "per_token"),
        ("silu_and_mul", "static"), ("silu_and_mul", "group")]


def rmsnorm_formula(x, w, eps=1e-6):
    """The rmsnorm formula as our reference writes it: the weight multiplied in fp32, one rounding."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def gemma_norm(x, w, eps=1e-6):
    """HF Gemma's ``GemmaRMSNorm``: ``(1 + w)`` in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


def _over_448(t):
    """``t / 448`` as vLLM writes it. On CUDA torch computes it as ``t * fp32(1 / 448)`` (a division by a
    number multiplies by its reciprocal there, eagerly and compiled), the fused ops' scale; the CPU
    divides, so there the pattern is written as that product."""
    return t / 448.0 if t.is_cuda else t * (1.0 / 448.0)


def quant_per_token(x):
    """vLLM's ``QuantFP8.forward_native``, dynamic per token."""
    x_max, _ = x.abs().max(dim=-1)
    scale = _over_448(x_max.unsqueeze(-1).to(torch.float32)).clamp(min=1.0 / (448.0 * 512.0))
    return (x.to(torch.float32) * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


def quant_per_token_amax(x):
    """The same with ``amax`` and ``1 / scale`` spelled differently."""
    xf = x.float()
    scale = torch.clamp(_over_448(xf.abs().amax(-1, keepdim=True)), min=1.0 / (448.0 * 512.0))
    return torch.clamp(xf * scale.reciprocal(), min=-448.0, max=448.0).to(FP8), scale


def quant_per_token_divided(x):
    """Per token with the amax divided by a tensor of 448s: IEEE division on every device, not the
    fused ops' product."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = (amax / torch.full_like(amax, 448.0)).clamp(min=1.0 / (448.0 * 512.0))
    return (xf * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


def quant_static(x, scale):
    """vLLM's static per-tensor quant: ``x * (1 / scale)``."""
    return (x.to(torch.float32) * (1.0 / scale)).clamp(-448.0, 448.0).to(FP8)


def quant_group(x, group_size=GROUP):
    """``per_token_group_quant_fp8``'s formula (eps 1e-10, x / scale)."""
    g = x.float().unflatten(-1, (-1, group_size))
    scale = g.abs().amax(-1).clamp(min=1e-10) / 448.0
    return (g / scale.unsqueeze(-1)).clamp(-448.0, 448.0).flatten(-2).to(FP8), scale


def fused_add_norm(x, residual, w, eps=1e-6):
    """``residual + x`` in fp32, normalised before rounding, the new residual rounded: our fused add."""
    s = x.float() + residual.float()
    return (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype), s.to(residual.dtype)


def silu_mul_ref(x):
    """Our reference's form: both halves upcast, one rounding."""
    half = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)


def _plain_cases():
    cases = {
        "rmsnorm formula + vLLM per token": (lambda x, w: quant_per_token(rmsnorm_formula(x, w)),
                                             lambda dev: (_exact_rows(T, H, device=dev), _weight(dev))),
        "F.rms_norm (3-D, fp16) + amax per token": (
            lambda x, w: quant_per_token_amax(F.rms_norm(x, (H,), w, 1e-5)),
            lambda dev: (_exact_rows(2, 4, H, dtype=torch.float16, device=dev), _weight(dev, torch.float16))),
        "F.rms_norm + static": (lambda x, w, s: quant_static(F.rms_norm(x, (H,), w, 1e-6), s),
                                lambda dev: (_exact_rows(T, H, device=dev), _weight(dev), _scale(dev))),
        "rmsnorm formula (fp32) + group": (lambda x, w: quant_group(rmsnorm_formula(x, w)),
                                           lambda dev: (_exact_rows(T, H, dtype=torch.float32, device=dev),
                                                        _weight(dev, torch.float32))),
        "Gemma formula + per token": (lambda x, w: quant_per_token(gemma_norm(x, w)),
                                      lambda dev: (_exact_rows(T, H, device=dev), _weight(dev))),
        "fused add formula + per token": (
            lambda x, r, w: (lambda y, res: (*quant_per_token(y), res))(*fused_add_norm(x, r, w)),
            lambda dev: (_exact_rows(T, H, device=dev), _exact_rows(T, H, device=dev) * 2, _weight(dev))),
        "fused add formula + group": (
            lambda x, r, w: (lambda y, res: (*quant_group(y), res))(*fused_add_norm(x, r, w)),
            lambda dev: (_exact_rows(T, H, device=dev), _exact_rows(T, H, device=dev) * 2, _weight(dev))),
        "silu formula + per token": (lambda x: quant_per_token(silu_mul_ref(x)), lambda dev: (_gate_up(T, 2 * H, device=dev),)),
        "F.silu(a) * b (fp32, chunk) + static": (
            lambda x, s: quant_static(F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1], s),
            lambda dev: (_gate_up(T, 2 * H, dtype=torch.float32, device=dev), _scale(dev))),
        "silu formula + group": (lambda x: quant_group(silu_mul_ref(x)), lambda dev: (_gate_up(T, 2 * H, device=dev),)),
        "our rmsnorm + vLLM per token": (lambda x, w: quant_per_token(d.rmsnorm(x, w, 1e-6)),
                                         lambda dev: (_random(T, H, device=dev), _weight(dev))),
        # a pointwise producer: rmsnorm and the group quant both decompose into their references
        "decomposed rmsnorm + group quant": (lambda x, w: d.per_token_group_quant_fp8(d.rmsnorm(x * 2, w, 1e-6), GROUP),
                                             lambda dev: (_exact_rows(T, H, device=dev), _weight(dev))),
    }
    return cases


PLAIN = _plain_cases()


def _case(name):
    if name in PLAIN:
        return PLAIN[name]
    producer, kind = name.split("+")
    return _ours(producer, kind)


NAMES = [f"{p}+{k}" for p, k in OURS] + list(PLAIN)
FUSED = {"rmsnorm": "rmsnorm_fp8_quant", "gemma_rmsnorm": "gemma_rmsnorm_fp8_quant",
         "fused_add_rmsnorm": "fused_add_rmsnorm_fp8_quant", "gemma_fused_add_rmsnorm": "gemma_fused_add_rmsnorm_fp8_quant",
         "silu_and_mul": "silu_and_mul_fp8_quant"}


@functools.lru_cache(maxsize=None)
def _run(name, device="cpu"):
    """``name`` compiled with the pass (its targets and outputs), without it, and eagerly, on the same
    fresh inputs (each run on its own copies: the fused add writes its residual)."""
    fn, make = _case(name)
    args = make(device)
    copy = lambda: [a.clone() for a in args]  # noqa: E731
    fused, targets = _compile(fn, copy())
    unfused, _ = _compile(fn, copy(), fusion=False, emulate=True)
    eager = fn(*copy())
    return targets, fused, unfused, eager


# ----------------------------------------------------------------------------------------------
# The rewrites


@pytest.mark.parametrize("name", NAMES)
def test_rewritten_graph_computes_the_same_bits(name):
    targets, fused, unfused, eager = _run(name)
    assert _fused_ops(targets), targets
    _assert_equal(fused, unfused, "with the pass against without")
    _assert_equal(fused, eager, "with the pass against eager")


class TestGoldens(expecttest.TestCase):
    def test_each_pattern_becomes_one_fused_op(self):
        """The post-grad graph of every pattern after the pass: the fused op, and nothing of the pair
        (the fused adds are functionalised: they write their residual)."""
        lines = [f"{name}: {' '.join(_run(name)[0].split())}" for name in NAMES]
        self.assertExpectedInline("\n".join(lines), """\
rmsnorm+per_token: deepinfer.rmsnorm_fp8_quant
rmsnorm+static: deepinfer.rmsnorm_fp8_quant
rmsnorm+group: deepinfer.rmsnorm_fp8_quant
rmsnorm+group_cm_ue8m0: deepinfer.rmsnorm_fp8_quant
gemma_rmsnorm+per_token: deepinfer.gemma_rmsnorm_fp8_quant
fused_add_rmsnorm+per_token: aten.mm auto_functionalized_v2(deepinfer.fused_add_rmsnorm_fp8_quant) aten.copy_
fused_add_rmsnorm+static: aten.mm auto_functionalized_v2(deepinfer.fused_add_rmsnorm_fp8_quant) aten.copy_
fused_add_rmsnorm+group: aten.mm auto_functionalized_v2(deepinfer.fused_add_rmsnorm_fp8_quant) aten.copy_
gemma_fused_add_rmsnorm+group: aten.mm auto_functionalized_v2(deepinfer.gemma_fused_add_rmsnorm_fp8_quant) aten.copy_
silu_and_mul+per_token: deepinfer.silu_and_mul_fp8_quant
silu_and_mul+static: deepinfer.silu_and_mul_fp8_quant
silu_and_mul+group: deepinfer.silu_and_mul_fp8_quant
rmsnorm formula + vLLM per token: deepinfer.rmsnorm_fp8_quant
F.rms_norm (3-D, fp16) + amax per token: deepinfer.rmsnorm_fp8_quant
F.rms_norm + static: deepinfer.rmsnorm_fp8_quant
rmsnorm formula (fp32) + group: deepinfer.rmsnorm_fp8_quant
Gemma formula + per token: deepinfer.gemma_rmsnorm_fp8_quant
fused add formula + per token: auto_functionalized_v2(deepinfer.fused_add_rmsnorm_fp8_quant)
fused add formula + group: auto_functionalized_v2(deepinfer.fused_add_rmsnorm_fp8_quant)
silu formula + per token: deepinfer.silu_and_mul_fp8_quant
F.silu(a) * b (fp32, chunk) + static: deepinfer.silu_and_mul_fp8_quant
silu formula + group: deepinfer.silu_and_mul_fp8_quant
our rmsnorm + vLLM per token: deepinfer.rmsnorm_fp8_quant
decomposed rmsnorm + group quant: aten.mul.Tensor deepinfer.rmsnorm_fp8_quant""")


# ----------------------------------------------------------------------------------------------
# Where it does not rewrite


def _fused_ops(targets):
    return [name for name in FUSED.values() if f"deepinfer.{name}" in _calls(targets)]


def _vllm_forward_native(x, w, eps=1e-6):
    """vLLM's ``RMSNorm.forward_native`` (and HF Llama's ``LlamaRMSNorm``): rounded to bf16 before the
    weight multiplies (two roundings)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _quant_bounds(x, bound=440.0, floor=1.0 / (448.0 * 512.0), divide=False):
    xf = x.float()
    scale = _over_448(xf.abs().amax(-1, keepdim=True)).clamp(min=floor)
    return ((xf / scale) if divide else (xf * scale.reciprocal())).clamp(-bound, bound).to(FP8), scale


def _quant_per_tensor(x):
    xf = x.float()
    scale = _over_448(xf.abs().amax()).clamp(min=1.0 / (448.0 * 512.0))
    return (xf * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


NOT_REWRITTEN = {
    "normalised value also returned": lambda x, w: (lambda y: (*quant_per_token(y), y))(rmsnorm_formula(x, w)),
    "clamp to 440": lambda x, w: _quant_bounds(rmsnorm_formula(x, w)),
    "scale floor 1e-6": lambda x, w: _quant_bounds(rmsnorm_formula(x, w), 448.0, 1e-6),
    "dynamic per tensor (a scale from y itself)": lambda x, w: _quant_per_tensor(rmsnorm_formula(x, w)),
    "x / scale per token": lambda x, w: _quant_bounds(rmsnorm_formula(x, w), 448.0, divide=True),
    "amax divided by a tensor of 448s per token": lambda x, w: quant_per_token_divided(rmsnorm_formula(x, w)),
    "group eps 1e-6": lambda x, w: (lambda g: ((g / (s := g.abs().amax(-1).clamp(min=1e-6) / 448.0).unsqueeze(-1))
                                              .clamp(-448.0, 448.0).flatten(-2).to(FP8), s))(
        rmsnorm_formula(x, w).float().unflatten(-1, (-1, GROUP))),
    "weight after the rounding (vLLM forward_native)": lambda x, w: quant_per_token(_vllm_forward_native(x, w)),
    "weight before the rsqrt": lambda x, w: quant_per_token(
        (x.float() * w * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)),
    "norm quantised unrounded": lambda x, w: quant_per_token(rmsnorm_formula(x.float(), w)),
    "fp32 norm rounded to bf16": lambda x, w: quant_per_token(rmsnorm_formula(x.float() * 2, w).to(BF16)),
    "F.silu(a) * b in bf16 (rounded twice)": lambda x, w: quant_per_token(F.silu(x[:, :H // 2]) * x[:, H // 2:]),
}


@pytest.mark.parametrize("name", list(NOT_REWRITTEN))
def test_plain_torch_that_differs_is_left_alone(name):
    targets = _targets_of(NOT_REWRITTEN[name], _random(T, H), _weight())
    assert "deepinfer." not in targets, targets


OURS_NOT_REWRITTEN = {
    "rmsnorm also returned": (lambda x, w: (*d.scaled_fp8_quant(y := d.rmsnorm(x, w, 1e-6), None, True), y),
                              ["rmsnorm", "scaled_fp8_quant"]),
    "group eps 1e-6": (lambda x, w: d.per_token_group_quant_fp8(d.rmsnorm(x, w, 1e-6), GROUP, 1e-6),
                       ["rmsnorm", "per_token_group_quant_fp8"]),
    "dynamic per tensor": (lambda x, w: d.scaled_fp8_quant(d.rmsnorm(x, w, 1e-6)), ["rmsnorm", "scaled_fp8_quant"]),
    "scale_ub": (lambda x, w: d.scaled_fp8_quant(d.rmsnorm(x, w, 1e-6), None, True, torch.full((1,), 2.0)),
                 ["rmsnorm", "scaled_fp8_quant"]),
    # the fused op leaves input as it was: the graph must write the normalised value back to x
    "fused_add_rmsnorm on a graph input": (lambda x, w: (d.fused_add_rmsnorm(x, r := x * 3, w, 1e-6),
                                                         *d.scaled_fp8_quant(x, None, True), r)[1:],
                                           ["fused_add_rmsnorm", "scaled_fp8_quant"]),
    # the FP8 norms take a weight: weight=None stays the unfused pair
    "rmsnorm without weight": (lambda x, w: d.scaled_fp8_quant(d.rmsnorm(x, None, 1e-6), None, True),
                               ["rmsnorm", "scaled_fp8_quant"]),
    "fused_add_rmsnorm without weight": (
        lambda x, w: (lambda h, r: (d.fused_add_rmsnorm(h, r, None, 1e-6), *d.scaled_fp8_quant(h, None, True), r)[1:])(
            x @ torch.eye(x.shape[-1], dtype=x.dtype), x * 3),
        ["fused_add_rmsnorm", "scaled_fp8_quant"]),
    "fused_add_rmsnorm input read again": (
        lambda x, w: (lambda h, r: (d.fused_add_rmsnorm(h, r, w, 1e-6), *d.scaled_fp8_quant(h, None, True), h + 1, r)[1:])(
            x.clone(), x * 3),
        ["fused_add_rmsnorm", "scaled_fp8_quant"]),
}


@pytest.mark.parametrize("name", list(OURS_NOT_REWRITTEN))
def test_our_pairs_that_differ_are_left_alone(name):
    fn, kept = OURS_NOT_REWRITTEN[name]
    targets = _targets_of(fn, _random(T, H), _weight())
    assert _fused_ops(targets) == [], targets
    for op in kept:
        assert f"deepinfer.{op}" in _calls(targets), (op, targets)


def test_fused_add_into_a_clone_adds_into_its_fresh_input_instead():
    """A layer that clones its hidden state to keep the caller's (``residual = h.clone()``, then
    ``fused_add_rmsnorm(o, residual)``): the fused op adds ``h`` into the projection's fresh output
    (the residual it writes), and every output has the bits of the graph without the pass."""
    def fn(h, wo, w):
        residual = h.clone()
        o = h @ wo
        d.fused_add_rmsnorm(o, residual, w, 1e-6)
        return (*d.scaled_fp8_quant(o, None, True), residual)

    class Probe(_Capture):  # the fused op's input and the residual it writes
        def __call__(self, graph):
            super().__call__(graph)
            self.calls = [(n.kwargs["input"].op, [b.target for b in n.kwargs["_all_bases"]])
                          for n in graph.nodes if n.target is torch.ops.higher_order.auto_functionalized_v2]

    args = (_random(T, H), _random(H, H) / 16, _weight())
    torch._dynamo.reset()
    probe = Probe()
    with inductor_config.patch(post_grad_custom_post_pass=fp8_fusion.as_slot((passes.FP8_FUSION, probe))):
        fused = torch.compile(fn, fullgraph=True)(*[a.clone() for a in args])
    assert _fused_ops(probe.targets) == ["fused_add_rmsnorm_fp8_quant"], probe.targets
    assert probe.calls == [("placeholder", [torch.ops.aten.mm.default])], probe.calls
    unfused, _ = _compile(fn, [a.clone() for a in args], fusion=False, emulate=True)
    _assert_equal(fused, unfused, "with the pass against without")
    _assert_equal(fused, fn(*args), "with the pass against eager")


def test_fused_add_keeps_a_clone_read_elsewhere():
    """The clone is also read after the fused add (its old value): nothing is swapped, still one fused op."""
    def fn(h, wo, w):
        residual = h.clone()
        o = h @ wo
        before = residual * 2
        d.fused_add_rmsnorm(o, residual, w, 1e-6)
        return (*d.scaled_fp8_quant(o, None, True), residual, before)

    args = (_random(T, H), _random(H, H) / 16, _weight())
    fused, targets = _compile(fn, [a.clone() for a in args])
    assert _fused_ops(targets) == ["fused_add_rmsnorm_fp8_quant"], targets
    _assert_equal(fused, fn(*args), "with the pass against eager")


# ----------------------------------------------------------------------------------------------
# Installing, caching, dynamic shapes


def test_install_composes_with_an_installed_pass_and_uninstall_restores_it():
    other = _Capture()
    with inductor_config.patch(post_grad_custom_post_pass=None):
        passes.install_fp8_fusion()
        assert inductor_config.post_grad_custom_post_pass is passes.FP8_FUSION
        passes.uninstall_fp8_fusion()
        assert inductor_config.post_grad_custom_post_pass is None
    with inductor_config.patch(post_grad_custom_post_pass=other):
        passes.install_fp8_fusion()
        passes.install_fp8_fusion()
        slot = inductor_config.post_grad_custom_post_pass
        assert fp8_fusion.custom_passes(slot) == (other, passes.FP8_FUSION)
        fn, make = _case("rmsnorm+per_token")
        torch._dynamo.reset()
        torch.compile(fn, fullgraph=True)(*make("cpu"))
        # the installed pass runs first, on the pair; ours after it
        assert other.targets == "deepinfer.rmsnorm\ndeepinfer.scaled_fp8_quant"
        passes.uninstall_fp8_fusion()
        assert inductor_config.post_grad_custom_post_pass is other


def test_install_chains_passes_where_the_slot_takes_one(monkeypatch):
    """Before torch 2.12 the slot holds one pass: install chains ours after the one there."""
    monkeypatch.setattr(fp8_fusion, "get_custom_graph_passes", None)
    other = _Capture()
    with inductor_config.patch(post_grad_custom_post_pass=other):
        passes.install_fp8_fusion()
        slot = inductor_config.post_grad_custom_post_pass
        assert isinstance(slot, fp8_fusion.ChainedPasses) and slot.passes == (other, passes.FP8_FUSION)
        assert slot.uuid() is None  # the capture has no uuid: Inductor must not cache
        passes.uninstall_fp8_fusion()
        assert inductor_config.post_grad_custom_post_pass is other
    chained = fp8_fusion.as_slot((passes.FP8_FUSION, passes.FP8_FUSION))
    assert chained.uuid() == repr([passes.FP8_FUSION.uuid()] * 2).encode()


def test_the_fx_graph_cache_keys_on_the_pass():
    """A pass without a uuid makes Inductor bypass its FX graph cache; ours has one, so a second
    compile of the same graph is served from the caches, rewritten."""
    fn, make = _case("silu_and_mul+group")
    args = make("cpu")
    assert isinstance(passes.FP8_FUSION.uuid(), bytes) and passes.FP8_FUSION.uuid()
    with inductor_config.patch(post_grad_custom_post_pass=None, fx_graph_cache=True):
        passes.install_fp8_fusion()
        counters.clear()
        outs = []
        for _ in range(2):
            torch._dynamo.reset()
            outs.append(torch.compile(fn, fullgraph=True)(*args))
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"] >= 1
    _assert_equal(outs[1], d.silu_and_mul_fp8_quant(args[0], None, GROUP), "from the cache against the fused op")


def test_one_graph_for_every_token_count():
    """A token count marked dynamic (``dynamic=True`` would also turn the Python float eps into a graph
    input, which a fused op cannot take as its float ``eps``)."""
    fn, make = _case("rmsnorm formula + vLLM per token")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True)
    capture = _Capture()
    with inductor_config.patch(post_grad_custom_post_pass=fp8_fusion.as_slot((passes.FP8_FUSION, capture))):
        for tokens in (2, 7, 33):
            x, w = _exact_rows(tokens, H), _weight()
            torch._dynamo.mark_dynamic(x, 0)
            _assert_equal(compiled(x, w), fn(x, w), f"{tokens} tokens")
    assert counters["deepinfer"]["fp8_fusion:rmsnorm_fp8_quant"] == 1  # one graph, rewritten once
    assert capture.targets == "deepinfer.rmsnorm_fp8_quant"


# ----------------------------------------------------------------------------------------------
# A model the pass has not seen


class Fp8Mlp(torch.nn.Module):
    """Pre-norm FP8 MLP layers in plain torch, as an engine might write them: the residual added and
    normalised in fp32, the activation quantised per token (vLLM's forward_native), ``torch._scaled_mm``
    with row-wise scales and FP8 weights, SiLU-and-mul, quantised again, the down projection."""

    def __init__(self, hidden=H, inter=2 * H, layers=2):
        super().__init__()
        self.inter = inter
        self.norms = torch.nn.ParameterList([torch.nn.Parameter(_random(hidden), requires_grad=False) for _ in range(layers)])
        self.ups = [self._fp8_weight(2 * inter, hidden) for _ in range(layers)]
        self.downs = [self._fp8_weight(hidden, inter) for _ in range(layers)]

    @staticmethod
    def _fp8_weight(n, k):
        w = torch.randn(n, k) / k ** 0.5
        scale = w.abs().amax(-1, keepdim=True) / 448.0
        return (w / scale).to(FP8), scale.reshape(1, n)

    def forward(self, x, residual):
        for norm, (w_up, s_up), (w_down, s_down) in zip(self.norms, self.ups, self.downs):
            s = x.float() + residual.float()
            residual = s.to(x.dtype)
            h = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.float()).to(x.dtype)
            q, scale = quant_per_token(h)
            gate_up = torch._scaled_mm(q, w_up.t(), scale_a=scale, scale_b=s_up, out_dtype=x.dtype)
            act = (F.silu(gate_up[:, :self.inter].float()) * gate_up[:, self.inter:].float()).to(x.dtype)
            q, scale = quant_per_token(act)
            x = torch._scaled_mm(q, w_down.t(), scale_a=scale, scale_b=s_down, out_dtype=x.dtype)
        return x, residual


class TestModel(expecttest.TestCase):
    def test_the_pass_fuses_a_model_it_has_not_seen(self):
        """Both layers' norm + quant and SiLU-mul + quant become fused ops. On the CPU the fused ops
        compute with the ATen ops the model calls (the same mean), so the compiled model with the pass
        equals the model run eagerly bit for bit; the model compiled without the pass differs from
        both by Inductor's order of the mean's sum (its norm reads a matmul's output)."""
        model = Fp8Mlp()
        x, residual = _random(T, H), _random(T, H)
        with inductor_config.patch(post_grad_custom_post_pass=None):
            passes.install_fp8_fusion()
            fused, targets = _compile(model, (x, residual), fusion=None)
        unfused, _ = _compile(model, (x, residual), fusion=False, emulate=True)
        self.assertExpectedInline(targets, """\
auto_functionalized_v2(deepinfer.fused_add_rmsnorm_fp8_quant)
aten.permute
aten._scaled_mm
deepinfer.silu_and_mul_fp8_quant
aten.permute
aten._scaled_mm
auto_functionalized_v2(deepinfer.fused_add_rmsnorm_fp8_quant)
aten.permute
aten._scaled_mm
deepinfer.silu_and_mul_fp8_quant
aten.permute
aten._scaled_mm""")
        _assert_equal(fused, model(x, residual), "with the pass against eager")
        for got, want in zip(fused, unfused):
            assert (got.float() - want.float()).norm() <= 0.05 * want.float().norm()


# ----------------------------------------------------------------------------------------------
# On CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("name", [f"{p}+{k}" for p, k in OURS])
def test_gpu_our_pairs_bit_for_bit(name):
    """Our pairs run our kernels unfused (their compiled route is opaque here: no pointwise op computes
    their input), the rewrite runs the fused kernel: equal bit for bit, by the fused ops' contract."""
    targets, fused, unfused, eager = _run(name, "cuda")
    assert targets == _run(name)[0]
    _assert_equal(fused, unfused, "with the pass against without")
    _assert_equal(fused, eager, "with the pass against eager")


#: the plain patterns that rewrite on CUDA, and the fused op each becomes
GPU_PLAIN = {
    "rmsnorm formula + vLLM per token": lambda x, w: d.rmsnorm_fp8_quant(x, w, 1e-6),
    "F.rms_norm + static": lambda x, w, s: d.rmsnorm_fp8_quant(x, w, 1e-6, s)[:1],
    "F.silu(a) * b (fp32, chunk) + static": lambda x, s: d.silu_and_mul_fp8_quant(x, s)[:1],
    "decomposed rmsnorm + group quant": lambda x, w: d.rmsnorm_fp8_quant(x * 2, w, 1e-6, None, GROUP),
}


def _assert_dequantised_close(got, want, args):
    got, want = _bits(got), _bits(want)
    scales = (got[1], want[1]) if len(got) > 1 else (args[-1], args[-1])  # static: the scale given
    if scales[0].shape != got[0].shape[:-1] + (1,) and scales[0].numel() > 1:  # group scales
        scales = tuple(s.repeat_interleave(got[0].shape[-1] // s.shape[-1], -1) for s in scales)
    a, b = (q.view(FP8).float() * s for q, s in zip((got[0], want[0]), scales))
    assert ((a - b).abs() <= 2 ** -3 * torch.maximum(a.abs(), b.abs()) + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_PLAIN))
def test_gpu_plain_patterns_become_the_fused_op(name):
    """On CUDA the primitives are each implementation's own (rsqrt and exp: ATen's, Inductor's and our
    kernels' differ in the last ulp, which can move a bf16 value and with it a scale), so the rewrite
    computes what our fused op computes, bit for bit, and dequantises to the plain formula's values
    within an fp8 step."""
    fn, make = _case(name)
    args = make("cuda")
    out, targets = _compile(fn, args)
    assert targets == _run(name)[0]
    want = GPU_PLAIN[name](*args)
    # Against the fused op called eagerly: the compiled graph's buffers may be aligned otherwise, which
    # changes Triton's load width and with it the order of the mean's sum (41 of 2048 q a step apart
    # measured); the fused op equals its own unfused pair bit for bit (tests/test_fp8_epilogues.py)
    _assert_dequantised_close(out, want, args)
    if name != "decomposed rmsnorm + group quant":
        got, ref = _bits(out), _bits(fn(*args))
        scales = (got[1], ref[1]) if len(got) > 1 else (args[-1], args[-1])  # static: the scale given
        deq_got, deq_ref = (q.view(FP8).float() * s for q, s in zip((got[0], ref[0]), scales))
        assert (deq_got - deq_ref).abs().max() <= 2 ** -3 * deq_ref.abs().max()


def test_division_by_a_python_448_on_the_cpu_is_left_alone():
    """vLLM's ``x_max / 448.0`` is an IEEE division on the CPU, not the fused ops' ``x_max * fp32(1 / 448)``
    (what CUDA computes for it, where it is rewritten: ``test_gpu_plain_patterns_become_the_fused_op``)."""
    fn = lambda x, w: (lambda y: (lambda s: ((y.float() * s.reciprocal()).clamp(-448.0, 448.0).to(FP8), s))(  # noqa: E731
        (y.float().abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))))(rmsnorm_formula(x, w))
    assert "deepinfer." not in _compile(fn, (_exact_rows(T, H), _weight("cpu")), stop=True)[1]
