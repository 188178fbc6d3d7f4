"""torch.compile: each op's compiled route (decompose / inductor_triton / opaque), its selection,
tracing with symbolic token counts, Inductor's output, CUDA graphs, and the decoder layer example.

On CPU the routes run the reference (``inductor_triton`` decomposes there, docs/compile.md), so CPU
tests check the selection, the rule under AOTAutograd (``aot_eager``: no C++ compile), a few
Inductor compiles, and the ``inductor_triton`` bodies traced on fake CUDA tensors in a process
without Triton's interpreter. The ``gpu`` tests check Inductor's CUDA output and CUDA graphs.
"""

import importlib
import os
import re
import subprocess
import sys

import expecttest
import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import torch_kernels
from torch_kernels import dispatch, ops, registry
from torch_kernels.dispatch import Selection, parse_compile_route
from torch_kernels.registry import DECOMPOSE, INDUCTOR_TRITON, OPAQUE
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close, clone_keep_strides, compare_outputs, mutated_args, outputs_of

from conftest import family_ops


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import decoder_layer  # noqa: E402

OP_NAMES = [op.name for op in ops.ALL]


def _overload(op):
    return getattr(torch.ops.deepinfer, op).default


def _block(op, clone_written=False):
    """``x*2 -> op``: a fusable neighbour before the op, whose outputs (and written arguments)
    are returned as they are, so that the op's own ``compare`` applies. ``clone_written``: the op
    writes copies of its other written arguments, not the graph's inputs (CUDA graphs skip a graph
    that writes its inputs)."""
    overload, mutated, data = _overload(op), mutated_args(_overload(op)), ops.BY_NAME[op].data_arg

    def fn(*args):
        args = tuple(a * 2 if i == data else a.clone() if clone_written and i in mutated else a
                     for i, a in enumerate(args))
        out = overload(*args)
        return [out] if isinstance(out, torch.Tensor) else list(out) if out is not None else [args[i] for i in mutated]
    return fn


def _routes_of(op, device):
    """The routes worth compiling ``op`` with on ``device``: ``inductor_triton`` decomposes off CUDA."""
    routes = registry.compile_routes(op)
    return [r for r in routes if device == "cuda" or r != INDUCTOR_TRITON]


def _cases(device):
    return [pytest.param(op, route, id=f"{op}-{route}") for op in OP_NAMES for route in _routes_of(op, device)]


# --- the route data and its selection (nothing compiled) ------------------------------------------------

def test_every_op_has_a_route_it_can_take_and_sampling_stays_opaque():
    assert set(registry.COMPILE_ROUTE) == set(registry.OPS)
    for op in registry.OPS:
        routes = registry.compile_routes(op)
        assert routes[0] == registry.COMPILE_ROUTE[op] and set(routes) <= set(registry.COMPILE_ROUTES)
    for op in family_ops("sampling"):
        assert registry.compile_routes(op) == [OPAQUE]


@pytest.mark.parametrize("spec, parsed", [
    ("", ()), (None, ()),
    ("opaque", (("*", "opaque"),)),
    (" rmsnorm = Decompose ", (("rmsnorm", "decompose"),)),
    ("opaque,rmsnorm=decompose", (("*", "opaque"), ("rmsnorm", "decompose"))),
    ({"rmsnorm": "inductor_triton", "silu_and_mul": "opaque"}, (("rmsnorm", "inductor_triton"), ("silu_and_mul", "opaque"))),
])
def test_parse_compile_route(spec, parsed):
    assert parse_compile_route(spec) == parsed


def test_compile_route_from_env_and_configure():
    sel = Selection.from_env({"DEEPINFER_OPS_COMPILE_ROUTE": "opaque,rmsnorm=decompose"}).validate()
    assert sel.forced_route("rmsnorm") == DECOMPOSE and sel.forced_route("silu_and_mul") == OPAQUE
    assert Selection.from_env({}).forced_route("rmsnorm") is None
    torch_kernels.configure(compile_route={"rotary_embedding": "inductor_triton"})
    assert dispatch.selection().forced_route("rotary_embedding") == INDUCTOR_TRITON
    assert dispatch.selection().forced_route("rmsnorm") is None


@pytest.mark.parametrize("spec, match", [
    ("fastest", "unknown route 'fastest'"),
    ("rms_norm=opaque", "unknown op 'rms_norm'"),
    ("top_k_top_p_sampling_from_probs=decompose", "cannot take route 'decompose': the reference sorts"),
])
def test_bad_compile_route_raises(spec, match):
    with pytest.raises(ValueError, match=match):
        torch_kernels.configure(compile_route=spec)
    with pytest.raises(ValueError, match=match):
        Selection.from_env({"DEEPINFER_OPS_COMPILE_ROUTE": spec}).validate()


def test_route_resolution_on_cuda(cuda_platform):
    for op in registry.OPS:
        assert dispatch.compile_route(op) == (registry.COMPILE_ROUTE[op], None)
    torch_kernels.configure(backend="triton", compile_route="inductor_triton")
    assert dispatch.compile_route("rmsnorm") == (INDUCTOR_TRITON, None)
    route, notice = dispatch.compile_route("top_k_top_p_sampling_from_probs")  # forced for all: keeps its own
    assert route == OPAQUE and "not 'inductor_triton': its Triton kernel" in notice
    # inductor_triton launches the Triton kernel: with another backend selected, an opaque call to it
    torch_kernels.configure(backend="torch")
    route, notice = dispatch.compile_route("rmsnorm")
    assert route == OPAQUE and "the CUDA key selects 'torch', not 'triton'" in notice


def test_route_after_a_pointwise_producer(cuda_platform):
    for op in registry.OPS:  # the ops of DECOMPOSE_AFTER_POINTWISE decompose, the others keep their route
        want = DECOMPOSE if op in registry.DECOMPOSE_AFTER_POINTWISE else registry.COMPILE_ROUTE[op]
        assert dispatch.compile_route(op, after_pointwise=True) == (want, None)
    assert "rotary_embedding" in registry.DECOMPOSE_AFTER_POINTWISE
    torch_kernels.configure(compile_route="rotary_embedding=opaque")  # a forced route wins
    assert dispatch.compile_route("rotary_embedding", after_pointwise=True) == (OPAQUE, None)


def test_route_resolution_off_cuda():
    torch_kernels.configure(compile_route="inductor_triton")
    assert dispatch.compile_route("rmsnorm", "cpu") == (DECOMPOSE, None)  # the reference runs here anyway
    torch_kernels.configure(compile_route=None)
    for op in registry.OPAQUE_OFF_CUDA:
        assert dispatch.compile_route(op, "cpu") == (OPAQUE, None)


def test_forced_routes_are_part_of_the_compile_cache_key():
    """AOTAutograd's and Inductor's caches key on the Dynamo graph, where the op is one node
    whatever its route: forcing a route must change the key, keeping the user's own tag."""
    import torch.compiler.config as cc

    saved = cc.cache_key_tag
    try:
        cc.cache_key_tag = "mine"
        torch_kernels.configure(compile_route="opaque")
        assert cc.cache_key_tag == "minedeepinfer-compile-route:*=opaque"
        torch_kernels.configure(compile_route={"rmsnorm": "decompose"})
        assert cc.cache_key_tag == "minedeepinfer-compile-route:rmsnorm=decompose"
        torch_kernels.configure(compile_route=None)
        assert cc.cache_key_tag == "mine"
    finally:
        cc.cache_key_tag = saved


def test_inventory_shows_each_compiled_route(cuda_platform):
    from torch_kernels.__main__ import _inventory, _inventory_notes

    torch_kernels.configure(compile_route="rmsnorm=opaque,topk_softmax=inductor_triton")
    header, *rows = _inventory(cuda_platform)
    routes = {r[0]: r[-1] for r in rows}
    assert header[-1] == "compiled route" and set(routes) == set(registry.OPS)
    assert routes["rmsnorm"] == "opaque (forced)"
    assert routes["silu_and_mul"] == "opaque*"  # decomposes after a pointwise op
    assert routes["grouped_topk"] == registry.COMPILE_ROUTE["grouped_topk"]
    assert routes["rotary_embedding"] == "opaque*"
    assert routes["topk_softmax"] == "inductor_triton (forced)"
    torch_kernels.configure(backend="torch")
    routes = {r[0]: r[-1] for r in _inventory(cuda_platform)[1:]}
    assert routes["topk_softmax"] == "opaque (note)"
    assert _inventory_notes(cuda_platform) == [
        "op 'topk_softmax' compiled as 'opaque', not 'inductor_triton': the CUDA key selects 'torch', not 'triton'"]


# --- Dynamo: one node per op ------------------------------------------------------------------------------

class TestDynamoGraph(expecttest.TestCase):
    def test_one_node_per_op(self):
        """The Dynamo FX graph of ``x*2 -> op`` for every op: the op is one node, whatever its route
        (the route applies below Dynamo, in AOTAutograd)."""
        lines = []
        for op in OP_NAMES:
            graphs = []

            def backend(gm, example_inputs):
                graphs.append(gm)
                return gm.forward
            torch._dynamo.reset()
            args, _ = ops.BY_NAME[op].tokens(3, "cpu")
            torch.compile(_block(op), backend=backend, fullgraph=True)(*args)
            (gm,) = graphs
            targets = [str(n.target) if isinstance(n.target, torch._ops.OpOverload) else n.target.__name__
                       for n in gm.graph.nodes if n.op == "call_function"]
            lines.append(f"{op}: {' -> '.join(targets)}")
        self.assertExpectedInline("\n".join(lines), """\
rmsnorm: mul -> deepinfer.rmsnorm.default
fused_add_rmsnorm: mul -> deepinfer.fused_add_rmsnorm.default
gemma_rmsnorm: mul -> deepinfer.gemma_rmsnorm.default
gemma_fused_add_rmsnorm: mul -> deepinfer.gemma_fused_add_rmsnorm.default
rmsnorm_fp8_quant: mul -> deepinfer.rmsnorm_fp8_quant.default -> getitem -> getitem
fused_add_rmsnorm_fp8_quant: mul -> deepinfer.fused_add_rmsnorm_fp8_quant.default -> getitem -> getitem
gemma_rmsnorm_fp8_quant: mul -> deepinfer.gemma_rmsnorm_fp8_quant.default -> getitem -> getitem
gemma_fused_add_rmsnorm_fp8_quant: mul -> deepinfer.gemma_fused_add_rmsnorm_fp8_quant.default -> getitem -> getitem
silu_and_mul: mul -> deepinfer.silu_and_mul.default
gelu_and_mul: mul -> deepinfer.gelu_and_mul.default
gelu_tanh_and_mul: mul -> deepinfer.gelu_tanh_and_mul.default
silu_and_mul_fp8_quant: mul -> deepinfer.silu_and_mul_fp8_quant.default -> getitem -> getitem
rotary_embedding: mul -> deepinfer.rotary_embedding.default
qk_rmsnorm_rope: mul -> deepinfer.qk_rmsnorm_rope.default
reshape_and_cache_flash: mul -> deepinfer.reshape_and_cache_flash.default
rotary_embedding_and_cache: mul -> deepinfer.rotary_embedding_and_cache.default
per_token_group_quant_fp8: mul -> deepinfer.per_token_group_quant_fp8.default -> getitem -> getitem
scaled_fp8_quant: mul -> deepinfer.scaled_fp8_quant.default -> getitem -> getitem
topk_softmax: mul -> deepinfer.topk_softmax.default -> getitem -> getitem
grouped_topk: mul -> deepinfer.grouped_topk.default -> getitem -> getitem
merge_attn_states: mul -> deepinfer.merge_attn_states.default -> getitem -> getitem
top_k_renorm_probs: mul -> deepinfer.top_k_renorm_probs.default
top_p_renorm_probs: mul -> deepinfer.top_p_renorm_probs.default
top_k_top_p_sampling_from_probs: mul -> deepinfer.top_k_top_p_sampling_from_probs.default
softmax: mul -> deepinfer.softmax.default
top_k_mask_logits: mul -> deepinfer.top_k_mask_logits.default
min_p_sampling_from_probs: mul -> deepinfer.min_p_sampling_from_probs.default
chain_speculative_sampling: mul -> deepinfer.chain_speculative_sampling.default -> getitem -> getitem -> getitem
sampling_from_probs: mul -> deepinfer.sampling_from_probs.default
sampling_from_logits: mul -> deepinfer.sampling_from_logits.default
top_k_top_p_sampling_from_logits: mul -> deepinfer.top_k_top_p_sampling_from_logits.default
sampled_token_logprobs: mul -> deepinfer.sampled_token_logprobs.default -> getitem -> getitem
all_reduce_fused_add_rmsnorm: mul -> deepinfer.all_reduce_fused_add_rmsnorm.default
all_reduce_fused_add_rmsnorm_fp8_quant: mul -> deepinfer.all_reduce_fused_add_rmsnorm_fp8_quant.default -> getitem -> getitem""")


# --- the rule under AOTAutograd (CPU: decompose and opaque) ------------------------------------------------

def _aot_graphs():
    """An ``aot_eager``-like backend that keeps each forward graph AOTAutograd produces."""
    graphs = []

    def fw_compiler(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return aot_autograd(fw_compiler=fw_compiler), graphs


def _deepinfer_calls(gm):
    """Nodes calling a deepinfer op, directly or through auto_functionalized(_v2)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        target = n.args[0] if "auto_functionalized" in str(n.target) else n.target
        if "deepinfer" in str(target):
            out.append(str(target))
    return out


def _few_samples(opdef):
    """The op's first sample, its first with zero tokens and its first with strided rows: each
    shape is a compile, so not all of them."""
    picked, kinds = [], set()
    for args in opdef.samples("cpu", torch.float32):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        kind = ("empty" if any(t.numel() == 0 for t in tensors) else
                "strided" if not all(t.is_contiguous() for t in tensors) else "plain")
        if kind not in kinds:
            kinds.add(kind)
            picked.append(args)
    return picked


@pytest.mark.parametrize("op, route", _cases("cpu"))
def test_route_under_aot_matches_eager(op, route):
    """Each route the op can take on CPU: what AOTAutograd hands the compiler (the reference's aten
    ops for decompose, one call of the op for opaque), and the results against eager, on zero
    tokens and strided rows as well."""
    torch_kernels.configure(compile_route={op: route})
    effective, _ = dispatch.compile_route(op, "cpu")
    torch._dynamo.reset()
    backend, graphs = _aot_graphs()
    fn, opdef, mutated = _block(op), ops.BY_NAME[op], mutated_args(_overload(op))
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for args in _few_samples(opdef):
        compare_outputs(opdef, outputs_of(compiled, args, mutated), outputs_of(fn, args, mutated), torch.float32)
    assert graphs
    for gm in graphs:
        assert _deepinfer_calls(gm) == ([] if effective == DECOMPOSE else [f"deepinfer.{op}.default"]), gm.code


@pytest.mark.parametrize("op", OP_NAMES)
def test_token_count_changes_do_not_recompile_through_aot(op):
    """The op's CPU route traced by AOTAutograd with an unbacked token count: one graph for 1, 0 and
    up to 300 tokens (tests/test_registration.py checks the same at Dynamo's level only)."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_block(op), backend=counter, fullgraph=True)
    opdef = ops.BY_NAME[op]
    for t in (3, 1, 0, 300):
        args, token_args = opdef.tokens(t, "cpu")
        want = _block(op)(*(clone_keep_strides(a) for a in args))  # the block returns what it writes
        for i in token_args:
            torch._dynamo.decorators.mark_unbacked(args[i], 0)
        compare_outputs(opdef, compiled(*args), want, torch.float32)
    assert counter.frame_count == 1


@pytest.mark.parametrize("route", [DECOMPOSE, OPAQUE])
def test_gradients_through_each_route(route):
    """A compiled training step: the decomposed reference and the opaque op's backward formula give
    eager's gradients."""
    torch_kernels.configure(compile_route={"rmsnorm": route})
    torch._dynamo.reset()
    x, w = torch.randn(4, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    fn = lambda x, w: (torch.ops.deepinfer.rmsnorm(x * 2, w) + 1).square().sum()  # noqa: E731
    got = torch.autograd.grad(torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w), (x, w))
    for g, e in zip(got, torch.autograd.grad(fn(x, w), (x, w))):
        assert_close(g, e)


def test_export_keeps_each_op_one_node():
    """torch.export keeps the op (as it keeps a triton_op): the exported program is meant to be
    lowered elsewhere, so no route applies, before or after run_decompositions."""
    class M(torch.nn.Module):
        def forward(self, x, w):
            return torch.ops.deepinfer.rmsnorm(x * 2, w) + 1

    ep = torch.export.export(M(), (torch.randn(4, 64), torch.randn(64)))
    for program in (ep, ep.run_decompositions()):
        assert [str(n.target) for n in program.graph.nodes if "deepinfer" in str(n.target)] == ["deepinfer.rmsnorm.default"]


# --- the inductor_triton route traced on fake CUDA tensors ---------------------------------------------------

_TRACE_TRITON_ROUTE = """
import logging, torch, torch_kernels
from torch_kernels import dispatch, ops, registry
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch._dynamo.source import ConstantSource
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

# No GPU: Triton's mutation analysis cannot lower the kernel, says so, and assumes every tensor written
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
dispatch.set_platform(torch_kernels.Platform("cuda", (9, 0), "pretend H200"))
torch_kernels.configure(backend="triton", compile_route="inductor_triton")
for op in registry.OPS:
    if registry.INDUCTOR_TRITON not in registry.compile_routes(op):
        continue
    args, token_args = ops.BY_NAME[op].tokens(5, "cpu")
    mode = FakeTensorMode(shape_env=ShapeEnv())
    source = ConstantSource("tokens")
    T = mode.shape_env.create_symintnode(
        mode.shape_env.create_symbol(5, source=source, dynamic_dim=DimDynamic.DYNAMIC), hint=5, source=source)
    with mode:  # fake CUDA tensors whose token dimension is the symbol T
        fake = tuple(torch.empty_strided((T, *a.shape[1:]) if i in token_args else a.shape, a.stride(),
                                         dtype=a.dtype, device="cuda")
                     if isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
        overload = getattr(torch.ops.deepinfer, op).default
        gm = make_fx(dispatch_functionalize(lambda *a: overload(*a)), tracing_mode="real")(*fake)
    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
               for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    calls = [str(n.target) for n in gm.graph.nodes if "deepinfer" in str(n.target)]
    guards = [str(g.expr) for g in mode.shape_env.guards]
    print(f"{op}|{','.join(kernels)}|{','.join(calls)}|{';'.join(guards)}")
"""


def test_inductor_triton_leaves_written_views_to_the_opaque_call(capsys):
    from torch_kernels import library
    opdef = ops.BY_NAME["rotary_embedding"]
    q, k, _ = torch.randn(6, 256).split([128, 64, 64], dim=-1)
    positions, cache = torch.randint(0, 16, (6,)), torch.randn(16, 32)
    assert library._written(opdef) == (1, 2)
    assert library._traced_triton(opdef, (positions, q, k, 32, cache, True)) is None
    assert "not 'inductor_triton', where it writes a non-contiguous view" in capsys.readouterr().err
    assert library._traced_triton(opdef, (positions, q.contiguous(), k.contiguous(), 32, cache, True)) is not None


def test_inductor_triton_route_traces_with_a_symbolic_token_count():
    """Every op's Triton body, run by the rule under FunctionalTensorMode with ``wrap_triton`` on fake
    CUDA tensors whose token count is a symbol: our kernel in the graph (no opaque call), and no
    guard on the token count but the launch limit (so no recompile when it changes). In a fresh
    process without Triton's interpreter, whose kernels wrap_triton cannot trace."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _TRACE_TRITON_ROUTE], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[0]: line.split("|")[1:] for line in r.stdout.splitlines() if "|" in line}
    traced = {op for op in registry.OPS if (op, INDUCTOR_TRITON) not in registry.NO_COMPILE_ROUTE}
    assert set(rows) == traced, r.stdout
    for op, (kernels, calls, guards) in rows.items():
        module = vars(importlib.import_module(registry.BY_OP[op][Backend.TRITON].target.partition(":")[0]))
        # @triton.jit functions of the op's own Triton module (interpreted or not), and no opaque call
        assert kernels and all(type(module.get(k)).__module__.startswith("triton.runtime") for k in kernels.split(",")), (op, kernels)
        assert calls == "", (op, calls)
        # only the launch-limit checks of the one-launch traced route: an upper bound, never a value
        assert all(re.fullmatch(r"s\d+ <= \d+", g) for g in filter(None, guards.split(";"))), (op, guards)


# --- Inductor's output on CPU (few compiles: each builds C++) -----------------------------------------------

def _call_body(code):
    """The ``call`` function of Inductor's output module: what runs per call."""
    return code[code.index("def call("):code.index("runner = Runner")] if "runner = Runner" in code else code


def _cpu_kernels(body):
    return re.findall(r"^\s+(cpp_fused_\w+)\(", body, re.M)


def test_inductor_cpu_decompose_fuses_neighbours_into_one_kernel():
    torch_kernels.configure(compile_route="rmsnorm=decompose")
    torch._dynamo.reset()
    x, w = torch.randn(8, 96), torch.randn(96)
    fn = lambda x, w: torch.ops.deepinfer.rmsnorm(x * 2, w) + 1  # noqa: E731
    out, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True), x, w)
    assert_close(out, fn(x, w))
    body = _call_body(code)
    assert len(_cpu_kernels(body)) == 1 and "torch.ops.deepinfer" not in body, body


def test_inductor_cpu_rmsnorm_decomposes_after_a_pointwise_op_only():
    """No route forced: after ``x * 2`` rmsnorm decomposes and Inductor fuses all into one kernel; on
    the graph's input it stays one call of our op (registry.DECOMPOSE_AFTER_POINTWISE)."""
    torch._dynamo.reset()
    x, w = torch.randn(8, 96), torch.randn(96)
    after_pointwise = lambda x, w: torch.ops.deepinfer.rmsnorm(x * 2, w) + 1  # noqa: E731
    on_input = lambda x, w: torch.ops.deepinfer.rmsnorm(x, w) + 1  # noqa: E731
    for fn in (after_pointwise, on_input):
        out, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True), x, w)
        assert_close(out, fn(x, w))
        body = _call_body(code)
        if fn is after_pointwise:
            assert len(_cpu_kernels(body)) == 1 and "torch.ops.deepinfer" not in body, body
        else:
            assert body.count("torch.ops.deepinfer.rmsnorm.default(") == 1, body


def test_a_clone_is_looked_through_for_the_pointwise_producer(monkeypatch):
    """A ``clone`` computes nothing: the op's route follows what produced the cloned tensor. On an
    input (as ``opcheck``'s AOT test traces it, cloning its inputs) the op stays opaque, so that test
    runs our kernel, not the reference; after ``x * 2`` and a clone it decomposes."""
    seen = []
    route = dispatch.compile_route
    monkeypatch.setattr(dispatch, "compile_route", lambda op, device, after_pointwise=False: (
        seen.append(after_pointwise), route(op, device, after_pointwise=after_pointwise))[1])
    op = torch.ops.deepinfer.per_token_group_quant_fp8.default
    x = torch.randn(3, 448).mul_(4).bfloat16()
    torch.library.opcheck(op, (x, 64, 1e-10, True, False), test_utils=("test_aot_dispatch_dynamic",))
    assert seen and not any(seen), seen
    torch._dynamo.reset()
    seen.clear()
    fn = lambda x: torch.ops.deepinfer.per_token_group_quant_fp8((x * 2).clone(), 64)  # noqa: E731
    torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    assert seen and seen[-1], seen  # the last trace: AOTAutograd's, with the graph below it


def _qkv_rope(x, wqkv, positions, cache):
    """The decoder layer's pattern: rotate q and k in place as views of the QKV projection's output."""
    qkv = x @ wqkv
    q, k, v = qkv.split([128, 64, 64], dim=-1)
    torch.ops.deepinfer.rotary_embedding(positions, q, k, 32, cache, True)
    return q, k, v


def _scaled_qkv_rope(qkv, positions, cache):
    """bench_compile.py's rope block: the producer of q and k is pointwise (``qkv * 2``)."""
    q, k, v = (qkv * 2).split([128, 64, 64], dim=-1)
    torch.ops.deepinfer.rotary_embedding(positions, q, k, 32, cache, True)
    return q + 1, k + 1


@pytest.mark.parametrize("case", ["pointwise-producer", "matmul-producer", "graph-inputs"])
def test_inductor_cpu_rope_route_follows_its_producer(case):
    """rotary_embedding decomposes where a pointwise op computes q and k (Inductor fuses that op, the
    rotation and the op after it into one kernel) and stays one opaque call after a matmul or on
    graph inputs (registry.DECOMPOSE_AFTER_POINTWISE)."""
    torch._dynamo.reset()
    positions, cache = torch.randint(0, 16, (6,)), torch.randn(16, 32)
    if case == "pointwise-producer":
        fn, args = _scaled_qkv_rope, (torch.randn(6, 256), positions, cache)
    elif case == "matmul-producer":
        fn, args = _qkv_rope, (torch.randn(6, 64), torch.randn(64, 256), positions, cache)
    else:
        fn = lambda q, k, p, c: (torch.ops.deepinfer.rotary_embedding(p, q, k, 32, c, True), q, k)[1:]  # noqa: E731
        args = (torch.randn(6, 128), torch.randn(6, 64), positions, cache)
    want = fn(*[a.clone() for a in args])
    out, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    for g, w in zip(out, want):
        assert_close(g, w)
    body = _call_body(code)
    if case == "pointwise-producer":
        assert "torch.ops.deepinfer" not in body and _cpu_kernels(body), body
    else:
        assert body.count("torch.ops.deepinfer.rotary_embedding.default(") == 1, body


def test_inductor_cpu_quant_decomposed_keeps_column_major_scales():
    """Decomposed with an unbacked token count, the scales keep the layout the op promises (DeepGEMM
    reads it): the reference computes them as (G, T) and returns the transposed view."""
    torch_kernels.configure(compile_route="per_token_group_quant_fp8=decompose")
    torch._dynamo.reset()
    fn = lambda x: torch.ops.deepinfer.per_token_group_quant_fp8(x * 2, 128, 1e-10, True, False)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    for tokens in (5, 64):
        x = torch.randn(tokens, 896)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        (q, s), (want_q, want_s) = compiled(x), fn(x)
        assert s.stride() == want_s.stride() == (1, tokens) and q.stride() == (896, 1)
        assert_close(s, want_s)
        assert_close(q.float(), want_q.float())


def _fused_add(x, residual, w):
    torch.ops.deepinfer.fused_add_rmsnorm(x, residual, w)


@pytest.mark.parametrize("case, route", [("fused_add_rmsnorm-graph-inputs", OPAQUE), ("rotary_embedding-qkv-views", OPAQUE),
                                         ("rotary_embedding-graph-inputs", OPAQUE), ("rotary_embedding-graph-inputs", DECOMPOSE)])
def test_inductor_cpu_in_place_ops_write_in_place_without_copies(case, route):
    """The in-place ops functionalise and come back in place: Inductor's output writes the graph
    inputs (or the projection's buffer) directly, with no copy of them. (On CPU the in-place norms
    stay opaque: registry.OPAQUE_OFF_CUDA.)"""
    op = case.split("-")[0]
    torch_kernels.configure(compile_route={op: route})
    torch._dynamo.reset()
    if case == "fused_add_rmsnorm-graph-inputs":
        fn, args = _fused_add, (torch.randn(6, 64), torch.randn(6, 64), torch.randn(64))
    elif case == "rotary_embedding-qkv-views":
        fn, args = _qkv_rope, (torch.randn(6, 64), torch.randn(64, 256), torch.randint(0, 16, (6,)), torch.randn(16, 32))
    else:
        fn = lambda q, k, p, c: torch.ops.deepinfer.rotary_embedding(p, q, k, 32, c, True)  # noqa: E731
        args = (torch.randn(6, 128), torch.randn(6, 64), torch.randint(0, 16, (6,)), torch.randn(16, 32))
    route, _ = dispatch.compile_route(op, "cpu")
    expected = [a.clone() for a in args]
    want = fn(*expected)
    out, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    for g, w in zip(list(args) + list(out or ()), expected + list(want or ())):
        assert_close(g, w)
    body = _call_body(code)
    assert "copy_(" not in body and "clone" not in body, body
    if route == OPAQUE:  # the op itself, on the input buffers or on views of the projection's output
        assert body.count(f"torch.ops.deepinfer.{op}.default(") == 1 and not _cpu_kernels(body), body
    else:  # one kernel that takes the written tensors as its outputs
        assert len(_cpu_kernels(body)) == 1, body


def test_decoder_layer_matches_plain_torch_on_cpu():
    """examples/decoder_layer.py: ours against the same layer in plain torch, eager and compiled
    (a small layer, fp32: both compute every op in fp32, so they agree to rounding). Compiled
    through AOTAutograd, where the routes apply, without Inductor's C++ build (30 s for a layer on
    two cores; the tests above check Inductor's CPU output op by op, the gpu test the layer)."""
    torch._dynamo.reset()
    cfg = decoder_layer.TINY
    ours, plain = decoder_layer.DecoderLayer(cfg, True), decoder_layer.DecoderLayer(cfg, False)
    positions, hidden = decoder_layer.inputs(cfg, 7)
    before = hidden.clone()
    want = plain(positions, hidden)
    for name, layer in [("ours", ours), ("ours compiled", torch.compile(ours, backend="aot_eager", fullgraph=True)),
                        ("plain compiled", torch.compile(plain, backend="aot_eager", fullgraph=True))]:
        got = layer(positions, hidden)
        errors = [decoder_layer.relative_error(g, w) for g, w in zip(got, want)]
        assert max(errors) < 1e-5, (name, errors)
        assert torch.equal(hidden, before), f"{name} wrote its input"


# Inductor clones the whole buffer when a graph's inputs are two written views of it (vLLM's
# kv_cache[0], kv_cache[1]) and copies half back: pytorch/pytorch#139628, open. On CUDA (torch 2.11)
# the clone read past the value cache (an illegal address); on CPU it reads the right bytes. The
# token-count tests therefore pass caches in buffers of their own (kv_cache.ops.caches_apart).
_WHOLE_BUFFER_COPY = pytest.mark.xfail(strict=True, reason="pytorch/pytorch#139628: see _WHOLE_BUFFER_COPY")


@_WHOLE_BUFFER_COPY
def test_inductor_writes_caches_viewing_one_buffer_in_place():
    """``reshape_and_cache_flash`` on ``kv[0]`` and ``kv[1]`` of one buffer, compiled on CPU: right, and
    no buffer the size of ``kv`` allocated (the op writes the caches where they lie)."""
    op = "reshape_and_cache_flash"
    torch_kernels.configure(compile_route={op: OPAQUE})
    torch._dynamo.reset()
    args, _ = ops.BY_NAME[op].tokens(7, "cpu")
    kv = torch.stack(args[2:4])
    args = (*args[:2], kv[0], kv[1], *args[4:])
    want = _block(op)(*(clone_keep_strides(a) for a in args))
    got, (code, *_) = run_and_get_code(torch.compile(_block(op), fullgraph=True), *args)
    compare_outputs(ops.BY_NAME[op], got, want, torch.float32)
    assert f"(({kv.numel()}, ), (1, )" not in code, _call_body(code)


# --- CUDA --------------------------------------------------------------------------------------------------

def _select(op, route):
    """Force ``route`` for ``op``; ``inductor_triton`` launches the Triton kernel, so Triton serves."""
    torch_kernels.configure(compile_route={op: route}, **({"backend": "triton"} if route == INDUCTOR_TRITON else {}))
    torch._dynamo.reset()


def _launches(code):
    """Names of the kernels Inductor's ``call`` launches (``name.run(...)``), in order."""
    return re.findall(r"(\w+)\.run\(", _call_body(code))


@pytest.mark.gpu
@pytest.mark.parametrize("op, route", _cases("cuda"))
def test_reduce_overhead_matches_eager(op, route):
    """mode="reduce-overhead" (CUDA graphs, recorded then replayed) gives what eager gives, sampling
    included, on every route the op can take, and no graph is skipped."""
    from torch._dynamo.utils import counters

    _select(op, route)
    counters.clear()
    opdef, fn = ops.BY_NAME[op], _block(op, clone_written=True)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    args = next(iter(opdef.samples("cuda", torch.bfloat16)))
    want = fn(*(clone_keep_strides(a) for a in args))
    for _ in range(3):  # warm-up, record, replay
        got = [t.clone() for t in compiled(*args)]  # the next replay overwrites the graph's outputs
        compare_outputs(opdef, got, want, torch.bfloat16)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.gpu
@pytest.mark.parametrize("op, route", _cases("cuda"))
def test_token_counts_1_to_16384_compile_once_on_cuda(op, route):
    """Inductor on CUDA, an unbacked token count: one graph for 1 to 16384 tokens."""
    _select(op, route)
    counter = CompileCounterWithBackend("inductor")
    opdef = ops.BY_NAME[op]
    compiled = torch.compile(_block(op), backend=counter, fullgraph=True)
    for t in (1, 7, 300, 16384):
        args, token_args = opdef.tokens(t, "cuda")
        want = _block(op)(*(clone_keep_strides(a) for a in args))
        for i in token_args:
            torch._dynamo.decorators.mark_unbacked(args[i], 0)
        compare_outputs(opdef, compiled(*args), want, torch.float32)
    assert counter.frame_count == 1


_KERNEL = {"rmsnorm": "_rmsnorm_rows", "fused_add_rmsnorm": "_rmsnorm_rows", "rotary_embedding": "_rope_kernel"}


@pytest.mark.gpu
@pytest.mark.parametrize("route", [DECOMPOSE, INDUCTOR_TRITON, OPAQUE])
def test_inductor_cuda_output_of_each_route(route):
    """``x*2 -> rmsnorm -> +1``: decompose is one fused kernel (as the block in plain torch);
    inductor_triton launches our kernel between the two neighbours; opaque calls the op."""
    _select("rmsnorm", route)
    x, w = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    fn = lambda x, w: torch.ops.deepinfer.rmsnorm(x * 2, w) + 1  # noqa: E731
    out, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True), x, w)
    assert_close(out, fn(x, w))
    launches, body = _launches(code), _call_body(code)
    if route == DECOMPOSE:
        assert len(launches) == 1 and "torch.ops.deepinfer" not in body, body
    elif route == INDUCTOR_TRITON:
        assert len(launches) == 3 and _KERNEL["rmsnorm"] in launches[1] and "torch.ops.deepinfer" not in body, body
    else:
        assert len(launches) == 2 and body.count("torch.ops.deepinfer.rmsnorm.default(") == 1, body


# Rotary embedding copies under the two non-opaque routes, measured on the H200 (torch 2.11): decomposed,
# Inductor computes each rotated tensor into a buffer and copies it back (the formula reads both halves
# of a row it writes). Through wrap_triton, q and k viewed from one qkv buffer were cloned and written
# back, and at 4096 tokens the kernel wrote past the clones (an illegal address: it had read the views'
# strides when traced), so written views now take the opaque call on that route. Its route is `opaque`
# (registry.COMPILE_ROUTE), which writes in place, or `decompose` after a pointwise producer.
_ROPE_COPIES = pytest.mark.xfail(strict=True, reason="rotary_embedding copies under this route: see _ROPE_COPIES")


def _in_place_cases():
    for route in (DECOMPOSE, INDUCTOR_TRITON, OPAQUE):
        for case in ("fused_add_rmsnorm-graph-inputs", "rotary_embedding-qkv-views", "rotary_embedding-graph-inputs"):
            copies = case.startswith("rotary") and route == DECOMPOSE
            yield pytest.param(case, route, marks=[_ROPE_COPIES] if copies else [], id=f"{route}-{case}")


@pytest.mark.gpu
@pytest.mark.parametrize("case,route", list(_in_place_cases()))
def test_inductor_cuda_in_place_ops_without_copies(case, route):
    """The in-place ops under every route, on the graph's inputs and on views of the QKV projection's
    output: written in place, no copy or clone of what they write (a clone would be one more
    kernel), and our kernel launched once on the inductor_triton route (rope on views: the opaque
    call, library._traced_triton)."""
    op = case.split("-")[0]
    _select(op, route)
    d = dict(device="cuda", dtype=torch.bfloat16)
    if case == "fused_add_rmsnorm-graph-inputs":
        fn, args = _fused_add, (torch.randn(64, 4096, **d), torch.randn(64, 4096, **d), torch.randn(4096, **d))
    elif case == "rotary_embedding-qkv-views":
        fn, args = _qkv_rope, (torch.randn(64, 64, **d), torch.randn(64, 256, **d),
                               torch.randint(0, 16, (64,), device="cuda"), torch.randn(16, 32, device="cuda"))
    else:
        fn = lambda q, k, p, c: torch.ops.deepinfer.rotary_embedding(p, q, k, 32, c, True)  # noqa: E731
        args = (torch.randn(64, 128, **d), torch.randn(64, 64, **d), torch.randint(0, 16, (64,), device="cuda"),
                torch.randn(16, 32, device="cuda"))
    expected = [a.clone() for a in args]
    want = fn(*expected)
    out, (code, *_) = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    for g, w in zip(list(args) + list(out or ()), expected + list(want or ())):
        assert_close(g, w)
    launches, body = _launches(code), _call_body(code)
    assert "copy_(" not in body and "clone" not in body, body
    if route == OPAQUE or (route == INDUCTOR_TRITON and case == "rotary_embedding-qkv-views"):
        assert body.count(f"torch.ops.deepinfer.{op}.default(") == 1 and not launches, body
    elif route == INDUCTOR_TRITON:
        assert len(launches) == 1 and _KERNEL[op] in launches[0], body
    else:  # decompose: at most a kernel per written tensor (q and k have different sizes)
        assert 1 <= len(launches) <= 2, body


@pytest.mark.gpu
@pytest.mark.parametrize("route", [None, INDUCTOR_TRITON, OPAQUE])
def test_decoder_layer_matches_plain_torch_on_cuda(route):
    """bf16, a Llama-shaped layer (narrower): eager, compiled and reduce-overhead against plain torch,
    with the measured routes (None) and with every op forced to one route."""
    torch_kernels.configure(compile_route=route, **({"backend": "triton"} if route == INDUCTOR_TRITON else {}))
    torch._dynamo.reset()
    cfg = decoder_layer.Config(hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2816, max_position=4096)
    ours, plain = (decoder_layer.DecoderLayer(cfg, flag, "cuda", torch.bfloat16) for flag in (True, False))
    positions, hidden = decoder_layer.inputs(cfg, 300, "cuda", torch.bfloat16)
    with torch.inference_mode():
        want = plain(positions, hidden)
        layers = {"compiled": torch.compile(ours, fullgraph=True),
                  "reduce-overhead": torch.compile(ours, mode="reduce-overhead", fullgraph=True),
                  "plain compiled": torch.compile(plain, fullgraph=True)}
        if route is None:
            layers["eager"] = ours
        for name, layer in layers.items():
            for _ in range(3):
                got = [t.clone() for t in layer(positions, hidden)]
            errors = [decoder_layer.relative_error(g, w) for g, w in zip(got, want)]
            assert max(errors) < 1e-2, (name, errors)  # bf16 roundings along a layer
