"""The registration: schemas (golden), opcheck, torch.compile tracing, bad input, the op reference."""

import subprocess
import sys

import expecttest
import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import torch_kernels
from torch_kernels import ops
from torch_kernels.testing import compare_outputs, mutated_args, outputs_of

from conftest import DEVICES, bits
from test_dispatch import ROOT

OP_NAMES = [op.name for op in ops.ALL]


def _overload(name):
    return getattr(torch.ops.deepinfer, name).default


class TestSchemas(expecttest.TestCase):
    def test_registered_schemas(self):
        text = "\n".join(str(_overload(op.name)._schema) for op in ops.ALL)
        self.assertExpectedInline(text, """\
deepinfer::rmsnorm(Tensor input, Tensor? weight, float eps=9.9999999999999995e-07) -> Tensor
deepinfer::fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, float eps=9.9999999999999995e-07) -> ()
deepinfer::gemma_rmsnorm(Tensor input, Tensor weight, float eps=9.9999999999999995e-07) -> Tensor
deepinfer::gemma_fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps=9.9999999999999995e-07) -> ()
deepinfer::rmsnorm_fp8_quant(Tensor input, Tensor weight, float eps=9.9999999999999995e-07, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) -> (Tensor, Tensor)
deepinfer::fused_add_rmsnorm_fp8_quant(Tensor input, Tensor(a!) residual, Tensor weight, float eps=9.9999999999999995e-07, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) -> (Tensor, Tensor)
deepinfer::gemma_rmsnorm_fp8_quant(Tensor input, Tensor weight, float eps=9.9999999999999995e-07, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) -> (Tensor, Tensor)
deepinfer::gemma_fused_add_rmsnorm_fp8_quant(Tensor input, Tensor(a!) residual, Tensor weight, float eps=9.9999999999999995e-07, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) -> (Tensor, Tensor)
deepinfer::silu_and_mul(Tensor input) -> Tensor
deepinfer::gelu_and_mul(Tensor input, str approximate="none") -> Tensor
deepinfer::gelu_tanh_and_mul(Tensor input) -> Tensor
deepinfer::silu_and_mul_fp8_quant(Tensor input, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) -> (Tensor, Tensor)
deepinfer::rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, Tensor cos_sin_cache, bool is_neox) -> ()
deepinfer::qk_rmsnorm_rope(Tensor positions, Tensor(a!) query, Tensor(b!)? key, Tensor q_weight, Tensor? k_weight, float eps, int head_size, Tensor cos_sin_cache, bool is_neox) -> ()
deepinfer::reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()
deepinfer::rotary_embedding_and_cache(Tensor positions, Tensor(a!) query, Tensor key, Tensor value, int head_size, Tensor cos_sin_cache, bool is_neox, Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()
deepinfer::per_token_group_quant_fp8(Tensor input, int group_size, float eps=1e-10, bool column_major_scales=False, bool scale_ue8m0=False) -> (Tensor, Tensor)
deepinfer::scaled_fp8_quant(Tensor input, Tensor? scale=None, bool per_token=False, Tensor? scale_ub=None) -> (Tensor, Tensor)
deepinfer::topk_softmax(Tensor gating_output, int topk, bool renormalize=False) -> (Tensor, Tensor)
deepinfer::grouped_topk(Tensor gating_output, int topk, bool renormalize, int num_expert_group, int topk_group, str scoring_func="softmax", Tensor? e_score_correction_bias=None, float routed_scaling_factor=1.) -> (Tensor, Tensor)
deepinfer::merge_attn_states(Tensor v_a, Tensor lse_a, Tensor v_b, Tensor lse_b) -> (Tensor, Tensor)
deepinfer::top_k_renorm_probs(Tensor probs, Tensor? maybe_top_k_arr, int top_k_val=0) -> Tensor
deepinfer::top_p_renorm_probs(Tensor probs, Tensor? maybe_top_p_arr, float top_p_val=1.) -> Tensor
deepinfer::top_k_top_p_sampling_from_probs(Tensor probs, Tensor? maybe_top_k_arr, Tensor? maybe_top_p_arr, Tensor seed, Tensor offset, int top_k_val=0, float top_p_val=1., str filter_apply_order="top_k_first", Tensor? indices=None) -> Tensor
deepinfer::softmax(Tensor logits, Tensor? maybe_temperature_arr=None, float temperature_val=1.) -> Tensor
deepinfer::top_k_mask_logits(Tensor logits, Tensor? maybe_top_k_arr=None, int top_k_val=0) -> Tensor
deepinfer::min_p_sampling_from_probs(Tensor probs, Tensor? maybe_min_p_arr, float min_p_val, Tensor seed, Tensor offset, Tensor? indices=None) -> Tensor
deepinfer::chain_speculative_sampling(Tensor draft_probs, Tensor draft_token_ids, Tensor target_probs, Tensor seed, Tensor offset) -> (Tensor, Tensor, Tensor)
deepinfer::sampling_from_probs(Tensor probs, Tensor seed, Tensor offset, Tensor? indices=None) -> Tensor
deepinfer::sampling_from_logits(Tensor logits, Tensor seed, Tensor offset) -> Tensor
deepinfer::top_k_top_p_sampling_from_logits(Tensor logits, Tensor? maybe_top_k_arr, int top_k_val, Tensor? maybe_top_p_arr, float top_p_val, Tensor? maybe_temperature_arr, float temperature_val, Tensor seed, Tensor offset, str filter_apply_order="top_k_first") -> Tensor
deepinfer::sampled_token_logprobs(Tensor logits, Tensor token_ids, Tensor? maybe_temperature_arr=None, float temperature_val=1.) -> (Tensor, Tensor)
deepinfer::all_reduce_fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, str group_name) -> ()
deepinfer::all_reduce_fused_add_rmsnorm_fp8_quant(Tensor input, Tensor(a!) residual, Tensor weight, float eps, str group_name, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) -> (Tensor, Tensor)""")


    def test_out_schemas(self):
        text = "\n".join(str(getattr(torch.ops.deepinfer, op.name).out._schema) for op in ops.ALL if op.out_names)
        self.assertExpectedInline(text, """\
deepinfer::rmsnorm.out(Tensor input, Tensor? weight, float eps=9.9999999999999995e-07, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::gemma_rmsnorm.out(Tensor input, Tensor weight, float eps=9.9999999999999995e-07, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::rmsnorm_fp8_quant.out(Tensor input, Tensor weight, float eps=9.9999999999999995e-07, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False, *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::fused_add_rmsnorm_fp8_quant.out(Tensor input, Tensor(a!) residual, Tensor weight, float eps=9.9999999999999995e-07, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False, *, Tensor(b!) out0, Tensor(c!) out1) -> (Tensor(b!), Tensor(c!))
deepinfer::gemma_rmsnorm_fp8_quant.out(Tensor input, Tensor weight, float eps=9.9999999999999995e-07, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False, *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::gemma_fused_add_rmsnorm_fp8_quant.out(Tensor input, Tensor(a!) residual, Tensor weight, float eps=9.9999999999999995e-07, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False, *, Tensor(b!) out0, Tensor(c!) out1) -> (Tensor(b!), Tensor(c!))
deepinfer::silu_and_mul.out(Tensor input, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::gelu_and_mul.out(Tensor input, str approximate="none", *, Tensor(a!) out) -> Tensor(a!)
deepinfer::gelu_tanh_and_mul.out(Tensor input, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::silu_and_mul_fp8_quant.out(Tensor input, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False, *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::per_token_group_quant_fp8.out(Tensor input, int group_size, float eps=1e-10, bool column_major_scales=False, bool scale_ue8m0=False, *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::scaled_fp8_quant.out(Tensor input, Tensor? scale=None, bool per_token=False, Tensor? scale_ub=None, *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::topk_softmax.out(Tensor gating_output, int topk, bool renormalize=False, *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::grouped_topk.out(Tensor gating_output, int topk, bool renormalize, int num_expert_group, int topk_group, str scoring_func="softmax", Tensor? e_score_correction_bias=None, float routed_scaling_factor=1., *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::merge_attn_states.out(Tensor v_a, Tensor lse_a, Tensor v_b, Tensor lse_b, *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::top_k_renorm_probs.out(Tensor probs, Tensor? maybe_top_k_arr, int top_k_val=0, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::top_p_renorm_probs.out(Tensor probs, Tensor? maybe_top_p_arr, float top_p_val=1., *, Tensor(a!) out) -> Tensor(a!)
deepinfer::top_k_top_p_sampling_from_probs.out(Tensor probs, Tensor? maybe_top_k_arr, Tensor? maybe_top_p_arr, Tensor seed, Tensor offset, int top_k_val=0, float top_p_val=1., str filter_apply_order="top_k_first", Tensor? indices=None, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::softmax.out(Tensor logits, Tensor? maybe_temperature_arr=None, float temperature_val=1., *, Tensor(a!) out) -> Tensor(a!)
deepinfer::top_k_mask_logits.out(Tensor logits, Tensor? maybe_top_k_arr=None, int top_k_val=0, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::min_p_sampling_from_probs.out(Tensor probs, Tensor? maybe_min_p_arr, float min_p_val, Tensor seed, Tensor offset, Tensor? indices=None, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::chain_speculative_sampling.out(Tensor draft_probs, Tensor draft_token_ids, Tensor target_probs, Tensor seed, Tensor offset, *, Tensor(a!) out0, Tensor(b!) out1, Tensor(c!) out2) -> (Tensor(a!), Tensor(b!), Tensor(c!))
deepinfer::sampling_from_probs.out(Tensor probs, Tensor seed, Tensor offset, Tensor? indices=None, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::sampling_from_logits.out(Tensor logits, Tensor seed, Tensor offset, *, Tensor(a!) out) -> Tensor(a!)
deepinfer::top_k_top_p_sampling_from_logits.out(Tensor logits, Tensor? maybe_top_k_arr, int top_k_val, Tensor? maybe_top_p_arr, float top_p_val, Tensor? maybe_temperature_arr, float temperature_val, Tensor seed, Tensor offset, str filter_apply_order="top_k_first", *, Tensor(a!) out) -> Tensor(a!)
deepinfer::sampled_token_logprobs.out(Tensor logits, Tensor token_ids, Tensor? maybe_temperature_arr=None, float temperature_val=1., *, Tensor(a!) out0, Tensor(b!) out1) -> (Tensor(a!), Tensor(b!))
deepinfer::all_reduce_fused_add_rmsnorm_fp8_quant.out(Tensor input, Tensor(a!) residual, Tensor weight, float eps, str group_name, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False, *, Tensor(b!) out0, Tensor(c!) out1) -> (Tensor(b!), Tensor(c!))""")


OUT_OPS = [op.name for op in ops.ALL if op.out_names]


def _random_like(t):
    """A tensor of ``t``'s shape, dtype and device holding random values (never zeros: a write shows)."""
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, device=t.device).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape, device=t.device) < 0.5
    return torch.randint(-1000, 1000, t.shape, device=t.device).to(t.dtype)


def _outs(op, args):
    """Random tensors shaped as the default overload's results on ``args``, by the op's out names."""
    results = _overload(op)(*args)
    results = (results,) if isinstance(results, torch.Tensor) else results
    return {name: _random_like(r) for name, r in zip(ops.BY_NAME[op].out_names, results)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OUT_OPS)
def test_out_overload_writes_what_the_default_returns(op, device):
    """``op.out(*args, out=...)`` returns its ``out`` tensors holding the default overload's results, bit
    for bit (the same random stream for the samplers)."""
    overload = getattr(torch.ops.deepinfer, op).out
    for args in ops.BY_NAME[op].samples(device, torch.float32):
        outs = _outs(op, _copies(args))
        default_args, out_args = _copies(args), _copies(args)  # each call writes the arguments it writes
        torch.manual_seed(0)
        want = _overload(op)(*default_args)
        torch.manual_seed(0)
        got = overload(*out_args, **outs)
        got, want = ((got,), (want,)) if isinstance(want, torch.Tensor) else (got, want)
        assert all(g is o for g, o in zip(got, outs.values()))
        for g, w in zip((*got, *out_args), (*want, *default_args)):  # the written arguments too
            if isinstance(w, torch.Tensor):
                assert g.dtype == w.dtype and torch.equal(bits(g), bits(w)), op


def _copies(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OUT_OPS)
def test_opcheck_out_overload(op, device):
    """opcheck of every ``out`` overload; its schema test compares written arguments with ``allclose``,
    which float8_e4m3fn lacks, so FP8 outputs skip that one (the schemas come from one generator,
    OpDef.out_schema, checked on every other op)."""
    for args in ops.BY_NAME[op].samples(device, torch.float32):
        outs = _outs(op, args)
        fp8 = any(o.dtype == torch.float8_e4m3fn for o in outs.values())
        utils = tuple(u for u in torch.library._OPCHECK_DEFAULT_UTILS if not (fp8 and u == "test_schema"))
        torch.library.opcheck(getattr(torch.ops.deepinfer, op).out, args, outs, test_utils=utils)


@pytest.mark.parametrize("op", ["silu_and_mul", "topk_softmax", "chain_speculative_sampling", "fused_add_rmsnorm_fp8_quant"])
def test_out_overload_refuses_outputs_of_another_shape_dtype_or_kind(op):
    """A wrong output is refused naming the op's out overload and the argument, before anything is
    written: neither another output nor an argument the op writes (the fused add's residual)."""
    args = next(iter(ops.BY_NAME[op].samples("cpu", torch.float32)))
    overload = getattr(torch.ops.deepinfer, op).out
    for name in ops.BY_NAME[op].out_names:
        for bad in ("shape", "dtype", "kind"):
            outs, call_args = _outs(op, _copies(args)), _copies(args)
            before = {n: t.clone() for n, t in outs.items()}
            t = outs[name]
            outs[name] = (torch.empty(*t.shape, 3, dtype=t.dtype) if bad == "shape" else
                          t.to(torch.float64 if t.dtype != torch.float64 else torch.float32) if bad == "dtype" else 1.0)
            # a non-tensor: the dispatcher's own refusal, naming the op's overload and the argument too
            with pytest.raises((ValueError, TypeError, RuntimeError), match=rf"deepinfer::{op}[.(].*argument '{name}'"):
                overload(*call_args, **outs)
            assert all(torch.equal(outs[n], before[n]) for n in outs if n != name), "written before the error"
            assert all(not isinstance(a, torch.Tensor) or torch.equal(bits(a), bits(b)) for a, b in zip(call_args, args))


def test_out_overload_refuses_an_output_on_the_written_residual():
    """An output sharing memory with the residual the op updates would be clobbered by, or clobber, the
    new residual: refused naming both, the residual unchanged."""
    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    before = residual.clone()
    op = torch.ops.deepinfer.fused_add_rmsnorm_fp8_quant.out
    q = torch.empty(4, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fused_add_rmsnorm_fp8_quant.out: argument 'out1' must not share memory "
                                         r"with the written argument 'residual'"):
        op(x, residual, weight, 1e-6, out0=q, out1=residual[:, :1])
    assert torch.equal(residual, before)


def test_out_overload_refuses_autograd():
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="silu_and_mul.out does not support autograd"):
        torch.ops.deepinfer.silu_and_mul.out(x, out=torch.randn(3, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["rmsnorm", "silu_and_mul", "topk_softmax", "merge_attn_states", "top_k_renorm_probs"])
def test_out_overload_compiles_with_the_copy_into_its_outputs(op, device):
    """Compiled (fullgraph, an unbacked token count), ``op.out`` writes the given outputs as eager does,
    one graph for every token count."""
    opdef, overload = ops.BY_NAME[op], getattr(torch.ops.deepinfer, op).out
    counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd: the functionalised copy into the outputs
    torch._dynamo.reset()
    compiled = torch.compile(lambda args, outs: overload(*args, **outs), backend=counter, fullgraph=True)
    for t in (3, 1, 300):
        args, token_args = opdef.tokens(t, device)
        outs = _outs(op, args)
        want = overload(*args, **{n: o.clone() for n, o in outs.items()})
        for t_arg in [args[i] for i in token_args] + [o for o in outs.values() if o.dim() and o.shape[0] == t]:
            torch._dynamo.decorators.mark_unbacked(t_arg, 0)
        got = compiled(args, outs)
        got, want = ((got,), (want,)) if isinstance(want, torch.Tensor) else (got, want)
        assert all(g is o for g, o in zip(got, outs.values()))
        for o, w in zip(outs.values(), want):
            assert torch.equal(bits(o), bits(w)), (op, t)
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OP_NAMES)
def test_opcheck(op, dtype, device):
    opdef = ops.BY_NAME[op]
    for args in opdef.samples(device, dtype):
        torch.library.opcheck(_overload(op), args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [op.name for op in ops.ALL if op.backward is not None])
def test_opcheck_with_gradients(op, device):
    for args in ops.BY_NAME[op].samples(device, torch.float32):
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.numel() else a for a in args)
        torch.library.opcheck(_overload(op), args)


def _block(op):
    """A small compiled region: a neighbour before (a copy of the data argument) and after (a copy)."""
    overload, mutated = _overload(op), mutated_args(_overload(op))
    data_arg = ops.BY_NAME[op].data_arg

    def fn(*args):
        args = tuple(a.clone() if i == data_arg else a for i, a in enumerate(args))
        out = overload(*args)
        outs = [out] if isinstance(out, torch.Tensor) else list(out) if out is not None else [args[i] for i in mutated]
        return [t.clone() for t in outs]  # outputs keep their dtype (fp8 has no arithmetic) for the op's compare
    return fn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_compile_fullgraph_one_node_matches_eager(op, device):
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = _block(op)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for args in ops.BY_NAME[op].samples(device, torch.float32):
        mutated = mutated_args(_overload(op))
        compare_outputs(ops.BY_NAME[op], outputs_of(compiled, args, mutated), outputs_of(fn, args, mutated), None)
    assert counter.frame_count >= 1 and counter.op_count >= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_compile_inductor_matches_eager(op, device):
    torch._dynamo.reset()
    fn = _block(op)
    compiled = torch.compile(fn, fullgraph=True)
    mutated = mutated_args(_overload(op))
    args = next(iter(ops.BY_NAME[op].samples(device, torch.bfloat16)))
    compare_outputs(ops.BY_NAME[op], outputs_of(compiled, args, mutated), outputs_of(fn, args, mutated), None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_token_count_changes_do_not_recompile(op, device):
    """Unbacked token counts: one graph for every count, 1 and 0 included. Backed dynamic shapes:
    one graph for every count >= 2 (Dynamo specialises 0 and 1 on its own)."""
    for mark, counts in [(torch._dynamo.decorators.mark_unbacked, [3, 8, 1, 17, 0, 300]),
                         (torch._dynamo.mark_dynamic, [3, 8, 17, 300])]:
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(_block(op), backend=counter, fullgraph=True)
        for t in counts:
            args, token_args = ops.BY_NAME[op].tokens(t, device)
            for i in token_args:
                mark(args[i], 0)
            compiled(*args)
        assert counter.frame_count == 1, (mark.__name__, counter.frame_count)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OP_NAMES)
def test_default_cuda_call_never_syncs_the_device(op):
    """Every op's default eager CUDA call, once its kernels are loaded, runs without a device sync
    (torch's sync debug mode raises on one): no check, seed draw or fallback reads a tensor back."""
    overload, opdef = _overload(op), ops.BY_NAME[op]
    rounds = [[tuple(a) for a in opdef.samples("cuda", torch.bfloat16)] for _ in range(2)]
    for args in rounds[0]:  # first calls compile and load the kernels
        overload(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for args in rounds[1]:
            overload(*args)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# --- bad input (each family tests its own cases; this checks the fake path) ---

def test_bad_input_raises_at_trace_time():
    compiled = torch.compile(lambda x, w: torch.ops.deepinfer.rmsnorm(x, w), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"deepinfer::rmsnorm: argument 'weight' must have shape \(64,\)"):
        compiled(torch.randn(4, 64), torch.randn(63))


# --- the wrappers and the op reference --------------------------------------------------------------

def test_wrappers_are_the_registered_ops():
    x, w = torch.randn(3, 40), torch.randn(40)
    for op in ops.ALL:
        assert op.wrapper is getattr(torch_kernels, op.name)
        assert op.wrapper.__doc__.startswith("``"), f"{op.name}: the docstring opens with the formula"
    assert torch.equal(torch_kernels.rmsnorm(x, w), torch.ops.deepinfer.rmsnorm(x, w))


def test_every_op_with_an_own_random_stream_says_what_it_may_draw():
    """The self-check holds a backend drawing from its own random stream to its op's ``check_draw``;
    it holds a reference's own draw too, and a draw outside the kept set fails it."""
    from torch_kernels import registry
    from torch_kernels.spec import Backend

    own = {op for op, _ in registry.OWN_RANDOM_STREAM}
    assert own and all(ops.BY_NAME[op].check_draw is not None for op in own), own
    for op in own:
        definition = ops.BY_NAME[op]
        for args in definition.samples("cpu", torch.float32):
            definition.check_draw(args, registry.BY_OP[op][Backend.TORCH].load()(*args))
        args = next(a for a in definition.samples("cpu", torch.float32) if a[0].shape[1] > 100)
        with pytest.raises(AssertionError, match="outside the kept set"):
            definition.check_draw(args, args[0].argmin(-1).int())


def test_docs_op_reference_is_up_to_date():
    r = subprocess.run([sys.executable, "-m", "torch_kernels", "docs", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_main_job_runs_the_self_check():
    r = subprocess.run([sys.executable, "-m", "torch_kernels"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all backends match the reference" in r.stdout
    for name in OP_NAMES:
        assert name in r.stdout


def test_inventory_imports_and_lists_every_op_with_torch_blocked():
    """The seed's promise: spec and registry import where torch is not installed, and list every op."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import torch_kernels, torch_kernels.spec, torch_kernels.registry as r\n"
            "print(sorted(r.OPS)); print(sorted({k.backend.value for k in r.KERNELS}))\n"
            "print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in "
            "('torch', 'triton', 'tilelang', 'flashinfer', 'numpy')))\n"
            "try:\n    torch_kernels.rmsnorm\nexcept AttributeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    op_list, backends, frameworks, error = r.stdout.splitlines()
    assert op_list == str(sorted(ops.BY_NAME))  # every registered op
    assert backends == str(sorted(b.value for b in torch_kernels.Backend))
    assert frameworks == "[]"
    assert "needs torch, which is not installed" in error
