"""The MoE routing family: ``topk_softmax`` (Mixtral/Qwen-style router) and ``grouped_topk`` (the
DeepSeek-V2/V3 router).

Semantics of vLLM's ``fused_topk``/``topk_softmax`` and ``grouped_topk``
(``vllm/model_executor/layers/fused_moe/fused_moe.py``) and sglang's ``topk_softmax``; the reference
is ``torch_kernels/families/moe/reference.py``. Both return fp32 weights and int32 expert ids ``(T, topk)``,
ordered by descending selection key, ties to the lower expert index. A score (probability or sigmoid)
that is not finite counts as 0, as in vLLM's ``topk_softmax`` kernel: the weights are finite and the
ids distinct whatever the logits hold.
"""

from typing import Iterator, Optional

import torch
from torch import Tensor

from ... import checks as check
from ...opdef import BenchCase, OpDef, assert_close

SCORING_FUNCS = ("softmax", "sigmoid")


# ----------------------------------------------------------------------------------------------
# Validation: the full checks (they name the argument at fault); the eager validators below try a
# cheap test of the common valid call first, as in norm.py.


def _validate_gating(op: str, gating_output: Tensor) -> None:
    check.tensor(op, "gating_output", gating_output)
    check.floating(op, "gating_output", gating_output)
    if gating_output.dim() != 2:
        check.fail(op, "gating_output", f"must be 2-D (tokens, experts), got shape {tuple(gating_output.shape)}")
    check.last_dim_contiguous(op, "gating_output", gating_output)
    check.require(gating_output.shape[1] >= 1, op, "gating_output", "must have at least one expert (dimension 1)")


def _validate_topk(op: str, topk: int, limit, what: str) -> None:
    check.require(topk >= 1, op, "topk", lambda: f"must be at least 1, got {topk}")
    check.require(topk <= limit, op, "topk", lambda: f"must be at most {what} ({limit}), got {topk}")


def _validate_topk_softmax(gating_output: Tensor, topk: int, renormalize: bool = False) -> None:
    op = "topk_softmax"
    _validate_gating(op, gating_output)
    _validate_topk(op, topk, gating_output.shape[1], "the number of experts")


def _validate_grouped_topk(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                           scoring_func: str = "softmax", e_score_correction_bias: Optional[Tensor] = None,
                           routed_scaling_factor: float = 1.0) -> None:
    op = "grouped_topk"
    _validate_gating(op, gating_output)
    experts = gating_output.shape[1]
    if scoring_func not in SCORING_FUNCS:
        check.fail(op, "scoring_func", f"must be one of {', '.join(map(repr, SCORING_FUNCS))}, got {scoring_func!r}")
    if num_expert_group < 1:
        check.fail(op, "num_expert_group", f"must be at least 1, got {num_expert_group}")
    check.require(experts % num_expert_group == 0, op, "num_expert_group",
                  lambda: f"must divide the number of experts ({experts}), got {num_expert_group}")
    if not 1 <= topk_group <= num_expert_group:
        check.fail(op, "topk_group", f"must be in [1, num_expert_group={num_expert_group}], got {topk_group}")
    group_size = experts // num_expert_group
    _validate_topk(op, topk, topk_group * group_size,
                   "the number of experts in the kept groups, topk_group * experts // num_expert_group")
    if e_score_correction_bias is not None:
        b = e_score_correction_bias
        check.tensor(op, "e_score_correction_bias", b)
        check.floating(op, "e_score_correction_bias", b)
        check.require(b.dim() == 1 and b.shape[0] == experts, op, "e_score_correction_bias",
                      lambda: f"must have shape ({experts},) to match the experts of 'gating_output', got {tuple(b.shape)}")
        check.last_dim_contiguous(op, "e_score_correction_bias", b)
        check.same_device(op, "e_score_correction_bias", b, "gating_output", gating_output)
        # the group score with a bias is the sum of the group's top two biased scores
        check.require(group_size >= 2, op, "num_expert_group",
                      lambda: f"must leave at least 2 experts per group when 'e_score_correction_bias' is given "
                              f"(the group score sums the top two), got {num_expert_group} groups of {group_size}")


def validate_topk_softmax(gating_output: Tensor, topk: int, renormalize: bool = False) -> None:
    try:
        if (gating_output.dtype in check.FLOATING and gating_output.dim() == 2 and gating_output.stride(1) == 1
                and 1 <= topk <= gating_output.shape[1]):
            return
    except (IndexError, RuntimeError, AttributeError):  # not a tensor, wrong rank: the full checks say what is wrong
        pass
    _validate_topk_softmax(gating_output, topk, renormalize)


def validate_grouped_topk(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                          scoring_func: str = "softmax", e_score_correction_bias: Optional[Tensor] = None,
                          routed_scaling_factor: float = 1.0) -> None:
    try:
        b = e_score_correction_bias
        if (gating_output.dtype in check.FLOATING and gating_output.dim() == 2 and gating_output.stride(1) == 1
                and scoring_func in SCORING_FUNCS and num_expert_group >= 1 and 1 <= topk_group <= num_expert_group):
            experts = gating_output.shape[1]
            group_size = experts // num_expert_group
            if (experts % num_expert_group == 0 and 1 <= topk <= topk_group * group_size
                    and (b is None or (b.dtype in check.FLOATING and b.dim() == 1 and b.shape[0] == experts
                                       and b.is_contiguous() and b.device == gating_output.device and group_size >= 2))):
                return
    except (IndexError, RuntimeError, AttributeError, TypeError):
        pass
    _validate_grouped_topk(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                           e_score_correction_bias, routed_scaling_factor)


def _outputs(gating_output: Tensor, topk: int):
    tokens = gating_output.shape[0]
    return (gating_output.new_empty((tokens, topk), dtype=torch.float32),
            gating_output.new_empty((tokens, topk), dtype=torch.int32))


def _fake_topk_softmax(gating_output: Tensor, topk: int, renormalize: bool = False):
    _validate_topk_softmax(gating_output, topk, renormalize)
    return _outputs(gating_output, topk)


def _fake_grouped_topk(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                       scoring_func: str = "softmax", e_score_correction_bias: Optional[Tensor] = None,
                       routed_scaling_factor: float = 1.0):
    _validate_grouped_topk(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                           e_score_correction_bias, routed_scaling_factor)
    return _outputs(gating_output, topk)


# ----------------------------------------------------------------------------------------------
# Typed wrappers: what IDEs show, and what docs/ops.md is generated from.


def topk_softmax(gating_output: Tensor, topk: int, renormalize: bool = False):
    """``p = softmax(gating_output, -1), non-finite as 0; ids = top-k indices of p; w = p[ids] (/ sum if renormalize)``

    The MoE router of Mixtral, Qwen-MoE and most top-k MoE models (vLLM's ``fused_topk`` /
    ``topk_softmax``, sglang's ``topk_softmax``). The softmax over the experts is computed in fp32
    (fp64 for fp64 input). The ``topk`` experts come in descending order of probability, ties to
    the lower expert index.

    Non-finite logits, as vLLM's ``topk_softmax`` kernel clamps them: a probability that is not
    finite counts as 0 before selection. A row with a NaN or ``+inf`` logit, or with only ``-inf``
    logits, has every probability NaN, so it routes to experts ``0 .. topk-1`` with weights 0 (the
    token adds nothing; renormalising a row of zeros leaves it zero). A ``-inf`` logit among finite
    ones is probability 0. So the weights are always finite and the ids distinct.

    Args:
        gating_output: ``(T, E)`` router logits, fp16/bf16/fp32/fp64, last dimension contiguous
            (rows may be strided). ``T`` may be 0.
        topk: experts per token, in ``[1, E]``.
        renormalize: divide the ``topk`` weights by their sum.

    Returns:
        ``(topk_weights, topk_ids)``: ``(T, topk)`` float32 and ``(T, topk)`` int32, contiguous.
        Not differentiable.
    """
    return torch.ops.deepinfer.topk_softmax.default(gating_output, topk, renormalize)


def grouped_topk(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                 scoring_func: str = "softmax", e_score_correction_bias: Optional[Tensor] = None,
                 routed_scaling_factor: float = 1.0):
    """``s = score(gating_output), non-finite as 0; ids = topk(s + bias) in the kept groups; w = s[ids] (/ sum) * factor``

    The DeepSeek-V2/V3 router, as vLLM's ``grouped_topk`` (``factor`` is ``routed_scaling_factor``).
    In fp32 (fp64 for fp64 input):

    1. ``s = softmax(gating_output, -1)`` or ``sigmoid(gating_output)`` (``scoring_func``); a score
       that is not finite counts as 0, as in :func:`topk_softmax` (softmax: every score of a row with
       a NaN or ``+inf`` logit, or of only ``-inf``; sigmoid: a NaN logit, ``+-inf`` giving 1 and 0).
    2. ``key = s + e_score_correction_bias`` (``key = s`` without a bias). The bias only selects.
    3. The ``E`` experts form ``num_expert_group`` consecutive groups; a group's score is the sum of
       its two largest keys with a bias, its largest key without one. The ``topk_group`` groups of
       highest score are kept.
    4. ``ids``: the ``topk`` experts of highest key among the kept groups, in descending key order.
    5. ``weights = s[ids]`` (the unbiased scores), divided by their sum if ``renormalize`` (a sum
       of 0 leaves the zeros), then
       multiplied by ``routed_scaling_factor``. vLLM applies the factor inside ``grouped_topk``,
       after the renormalisation, and so does this op (older vLLM releases' ``grouped_topk`` had no
       factor and the model scaled the MoE output: pass 1.0 to get their weights).

    Ties resolve to the lower index, for groups and for experts; a NaN key (from a NaN bias) ranks
    as ``+inf``. The weights are finite (for a finite factor) and the ids distinct whatever the logits
    and bias hold: a row whose scores are all 0 selects by the bias alone (experts ``0 .. topk-1``
    without one) with weights 0. vLLM's CUDA ``grouped_topk`` instead leaves an expert with a
    non-finite logit out of its final choice, so such rows may route differently there.
    Unlike vLLM's native path (which rounds softmax scores to the logits' dtype), the scores stay fp32.

    Args:
        gating_output: ``(T, E)`` router logits, fp16/bf16/fp32/fp64, last dimension contiguous
            (rows may be strided). ``T`` may be 0.
        topk: experts per token, in ``[1, topk_group * E // num_expert_group]``.
        renormalize: divide the ``topk`` weights by their sum (before the scaling factor).
        num_expert_group: number of groups; divides ``E``; with a bias, groups need at least 2 experts.
        topk_group: groups kept, in ``[1, num_expert_group]``.
        scoring_func: ``"softmax"`` or ``"sigmoid"``.
        e_score_correction_bias: optional ``(E,)`` floating bias, contiguous, on the device of
            ``gating_output``.
        routed_scaling_factor: multiplies the final weights; default 1.0.

    Returns:
        ``(topk_weights, topk_ids)``: ``(T, topk)`` float32 and ``(T, topk)`` int32, contiguous.
        Not differentiable.
    """
    return torch.ops.deepinfer.grouped_topk.default(gating_output, topk, renormalize, num_expert_group, topk_group,
                                                    scoring_func, e_score_correction_bias, routed_scaling_factor)


# ----------------------------------------------------------------------------------------------
# Comparing a backend with the reference: ids exactly, weights at the fp32 tolerance (they are fp32
# whatever the logits' dtype, and both sides compute them in fp32 from the same logits).


def compare_routing(got: list, want: list, dtype, skip_rows: Optional[Tensor] = None) -> None:
    """``got`` (weights, ids) against ``want``: ids exactly, weights at the fp32 tolerance. Rows
    where ``skip_rows`` is True are left out (see :func:`near_ties`)."""
    assert len(got) == len(want) == 2, f"{len(got)} outputs, expected 2"
    (w, ids), (w_ref, ids_ref) = got, want
    assert ids.dtype == torch.int32 and w.dtype == torch.float32, f"dtypes {w.dtype}, {ids.dtype}"
    assert ids.shape == ids_ref.shape and w.shape == w_ref.shape, f"shapes {tuple(w.shape)}, {tuple(ids.shape)}"
    if skip_rows is not None:
        keep = ~skip_rows
        w, ids, w_ref, ids_ref = w[keep], ids[keep], w_ref[keep], ids_ref[keep]
    if not torch.equal(ids, ids_ref):
        rows = (ids != ids_ref).any(-1).nonzero().flatten().tolist()
        raise AssertionError(f"expert ids differ in {len(rows)} row(s), first {rows[:5]}: "
                             f"got {ids[rows[0]].tolist()}, expected {ids_ref[rows[0]].tolist()}")
    assert_close(w, w_ref, torch.float32, msg="topk weights")


def near_ties(op: str, args: tuple, rtol: float = 2e-6) -> Tensor:
    """Rows of a router call whose decision hinges on two keys closer than ``rtol`` (relative, in
    fp64): adjacent among the ``topk`` (+1) best experts, or among the ``topk_group`` (+1) best
    groups; equal keys are not near ties. Two fp32 implementations whose keys differ by a few ulp
    (Triton's exp and sigmoid against torch's) may order near ties either way. ``2e-6`` is about
    16 ulp near 1: random logits at 8192 x 256 top-8 give ~2 such rows (softmax) and ~10
    (DeepSeek-V3 sigmoid + bias, whose keys crowd near 1), which large-shape checks leave out."""
    x = args[0].double()
    if op == "topk_softmax":
        key, topk = torch.softmax(x, -1).nan_to_num(0.0, 0.0, 0.0), args[1]
        group_key = None
    else:
        topk, _, groups, topk_group, scoring, bias, _ = args[1:8] + (None,) * (8 - len(args))
        scoring = scoring or "softmax"
        scores = (torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)).nan_to_num(0.0, 0.0, 0.0)
        key = scores if bias is None else scores + bias.double()
        grouped = key.view(x.shape[0], groups, -1)
        group_key = grouped.amax(-1) if bias is None else grouped.topk(2, -1).values.sum(-1)
        kept = torch.zeros_like(group_key, dtype=torch.bool).scatter_(1, group_key.topk(topk_group, -1).indices, True)
        key = key.masked_fill(~kept.repeat_interleave(x.shape[1] // groups, 1), float("-inf"))
        group_key = group_key if topk_group < groups else None
    tie = _close_neighbours(key, topk + (topk < key.shape[1]), rtol, exact_ties=False)
    if group_key is not None:
        # equal group scores count: two different pairs of keys can sum equal in fp64 and not in fp32
        tie |= _close_neighbours(group_key, topk_group + 1, rtol, exact_ties=True)
    return tie


def _close_neighbours(key: Tensor, n: int, rtol: float, exact_ties: bool) -> Tensor:
    top = key.topk(n, -1).values
    a, b = top[:, :-1], top[:, 1:]
    gap = a - b  # equal keys come from equal logits (and bias): every implementation ties them alike
    return (((gap > 0) | exact_ties) & (gap <= rtol * torch.maximum(a.abs(), b.abs())) & b.isfinite()).any(-1)


# ----------------------------------------------------------------------------------------------
# Sample arguments for opcheck, the self-check and the tests: awkward shapes, never zeros.


def _gating(tokens: int, experts: int, stride: Optional[int], device, dtype, scale: float = 2.0) -> Tensor:
    if stride is None:
        return torch.randn(tokens, experts, device=device, dtype=dtype) * scale
    return (torch.randn(tokens, stride, device=device, dtype=dtype) * scale)[:, :experts]


#: (tokens, experts, row stride or None, topk, renormalize): one token, top-k = E, zero tokens,
#: expert counts that are not powers of two, strided rows, a real router (256 experts, top 8).
TOPK_SOFTMAX_SAMPLES = ((1, 8, None, 2, False), (5, 60, None, 6, True), (0, 16, None, 4, False),
                        (2, 5, None, 5, True), (4, 96, 160, 3, False), (3, 256, None, 8, True))

#: (tokens, experts, row stride, topk, renormalize, groups, topk_group, scoring, bias dtype or None
#: (None: no bias; "same": the logits' dtype), scaling factor): DeepSeek-V3 (256 experts, 8 groups,
#: keep 4, top 8, sigmoid + fp32 bias, 2.5), groups of a non-power-of-two size, a non-power-of-two
#: group count, one group, softmax scoring, zero tokens, strided rows.
GROUPED_TOPK_SAMPLES = (
    (1, 16, None, 2, True, 4, 2, "sigmoid", torch.float32, 2.5),
    (5, 64, None, 6, False, 8, 3, "softmax", None, 1.0),
    (0, 32, None, 4, True, 4, 2, "sigmoid", torch.float32, 1.0),
    (3, 48, None, 5, True, 4, 2, "sigmoid", "same", 1.5),
    (4, 96, 160, 7, True, 6, 3, "softmax", torch.float32, 1.0),
    (2, 24, None, 3, False, 1, 1, "sigmoid", None, 1.0),
    (3, 256, None, 8, True, 8, 4, "sigmoid", torch.float32, 2.5),
)


def _samples_topk_softmax(device, dtype) -> Iterator[tuple]:
    for tokens, experts, stride, topk, renormalize in TOPK_SOFTMAX_SAMPLES:
        yield _gating(tokens, experts, stride, device, dtype), topk, renormalize


def grouped_topk_args(tokens, experts, stride, topk, renormalize, groups, topk_group, scoring, bias_dtype, factor,
                      device, dtype) -> tuple:
    """The arguments of one ``GROUPED_TOPK_SAMPLES`` row (tests and benchmarks build theirs the same way)."""
    bias = None
    if bias_dtype is not None:
        bias = (torch.rand(experts, device=device) * 0.2 - 0.1).to(dtype if bias_dtype == "same" else bias_dtype)
    return (_gating(tokens, experts, stride, device, dtype), topk, renormalize, groups, topk_group, scoring, bias, factor)


def _samples_grouped_topk(device, dtype) -> Iterator[tuple]:
    for row in GROUPED_TOPK_SAMPLES:
        yield grouped_topk_args(*row, device=device, dtype=dtype)


def _tokens_topk_softmax(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device), 4, True), (0,)


def _tokens_grouped_topk(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device), 4, True, 8, 2, "sigmoid", torch.randn(64, device=device) * 0.1, 2.5), (0,)


# ----------------------------------------------------------------------------------------------
# Benchmark cases: tokens x experts of fp32 logits (DeepSeek-V3's router runs in fp32), whatever the
# data dtype asked for. Rounds of selection over each row: no copy-bandwidth goal.

#: per profile: (experts, topk, groups, groups kept); gpu: DeepSeek-V3 (grouped_topk: sigmoid + bias, x2.5)
BENCH_SIZES = {"gpu": (256, 8, 8, 4), "cpu": (64, 4, 8, 2)}


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    experts, topk, _, _ = BENCH_SIZES[profile]
    return tokens, None, f"{tokens}x{experts} top{topk}"


def _bench_args_topk_softmax(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    experts, topk, _, _ = BENCH_SIZES[profile]
    return torch.randn(rows, experts, device=device, dtype=torch.float32) * 2, topk, True


def _bench_args_grouped_topk(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    experts, topk, groups, kept = BENCH_SIZES[profile]
    return grouped_topk_args(rows, experts, None, topk, True, groups, kept, "sigmoid", torch.float32, 2.5,
                             device=device, dtype=torch.float32)


def _bench_nbytes(args: tuple) -> int:
    x, bias = args[0], args[6] if len(args) > 6 else None
    # the logits, fp32 weights + int32 ids, the bias
    return (x.numel() * x.element_size() + x.shape[0] * args[1] * 8
            + (0 if bias is None else bias.numel() * bias.element_size()))


def _bench_compare(op: str):
    def compare(got: list, want: list, dtype, args: tuple) -> None:
        compare_routing(got, want, dtype, near_ties(op, args))  # near ties may be ordered either way, as in the tests
    return compare


def _bench(op: str, args) -> BenchCase:
    return BenchCase(_bench_shape, args, _bench_nbytes, compare=_bench_compare(op),
                     flashinfer=lambda args: "not timed: FlashInfer's routers (fused_moe) build a JIT module for "
                                             "several minutes")


_NO_GRAD = "routing is not differentiable (integer ids; the weights are gathered probabilities)"

OPS = (
    OpDef("topk_softmax(Tensor gating_output, int topk, bool renormalize=False) -> (Tensor, Tensor)",
          validate_topk_softmax, _fake_topk_softmax, topk_softmax, _samples_topk_softmax, _tokens_topk_softmax,
          no_grad_reason=_NO_GRAD, compare=compare_routing, bench=_bench("topk_softmax", _bench_args_topk_softmax)),
    OpDef("grouped_topk(Tensor gating_output, int topk, bool renormalize, int num_expert_group, int topk_group, "
          "str scoring_func=\"softmax\", Tensor? e_score_correction_bias=None, float routed_scaling_factor=1.0) "
          "-> (Tensor, Tensor)",
          validate_grouped_topk, _fake_grouped_topk, grouped_topk, _samples_grouped_topk, _tokens_grouped_topk,
          no_grad_reason=_NO_GRAD, compare=compare_routing, bench=_bench("grouped_topk", _bench_args_grouped_topk)),
)
