"""torch.compile on a CUDA GPU: each op's compiled routes against the same block in plain torch
compiled, and the decoder layer (examples/decoder_layer.py) eager, compiled and reduce-overhead,
ours against plain torch. What registry.COMPILE_ROUTE is set from.

    python benchmarks/bench_compile.py --out docs/benchmarks/compile_ops.json

Op blocks (bf16, Llama-8B-like shapes, ``--tokens`` tokens): ``x*2 -> op -> +1`` ("block": the
neighbours Inductor may fuse) and the op alone ("alone": what it costs between two GEMMs), compiled
with each route the op can take (``inductor_triton`` with Triton selected), with no route forced
("measured": the op's own choice, which for ``registry.DECOMPOSE_AFTER_POINTWISE`` depends on the
block) and with the op replaced
by its reference formula ("plain": the same block in plain torch), each checked against eager
before it is timed; device µs by CUDA-graph replay. Decoder layer (Llama-3-8B: hidden 4096, 32/8
heads, 14336 intermediate; bf16) at ``--layer-tokens``: µs per call between CUDA events (the host
included: what each mode costs a caller) and the device µs of a CUDA-graph replay of the eager and
compiled calls; compiled again with every op forced to each route.
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import decoder_layer  # noqa: E402
import torch_kernels  # noqa: E402
from benchmarks import harness  # noqa: E402
from torch_kernels import dispatch, registry  # noqa: E402
from torch_kernels.families.activation import reference as activation  # noqa: E402
from torch_kernels.families.attention import reference as attention  # noqa: E402
from torch_kernels.families.moe import reference as moe  # noqa: E402
from torch_kernels.families.norm import reference as norm  # noqa: E402
from torch_kernels.families.quant import reference as quant  # noqa: E402
from torch_kernels.families.rope import reference as rope  # noqa: E402
from torch_kernels.families.sampling import reference as sampling  # noqa: E402
from torch_kernels.families.rope.ops import make_cos_sin_cache  # noqa: E402

DEVICE = "cuda"  # a CPU dry run of the blocks and checks sets it to "cpu"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
VOCAB, SAMPLING_ROWS = 128256, 64


def _ops(t: int) -> dict:
    """Per op: (arguments for ``t`` tokens, block(op, *args) -> outputs, the reference). The block's
    first step is the neighbour before (``x*2``), its last the one after (``+1`` on each output
    that takes it); ``alone`` drops both."""
    def post(out):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return tuple(o + 1 if o.dtype != torch.float8_e4m3fn else o for o in outs)

    def simple(data_arg=0):
        def block(op, *args, alone=False):
            args = list(args)
            if not alone:
                args[data_arg] = args[data_arg] * 2
            out = op(*args)
            return out if alone else post(out)
        return block

    def in_place(written):  # returns what the op wrote
        def block(op, *args, alone=False):
            args = list(args)
            if not alone:
                args[written[0]] = args[written[0]] * 2
            op(*args)
            outs = tuple(args[i] for i in written)
            return outs if alone else post(outs)
        return block

    def qkv_rope(op, positions, qkv, cache, alone=False):  # q and k as views of the QKV output, as in a layer
        qkv = qkv if alone else qkv * 2
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        op(positions, q, k, HEAD_DIM, cache, True)
        return (q, k) if alone else post((q, k))

    def sampled(op, logits, *args, alone=False):  # the neighbour before is the softmax making the probs
        out = op(torch.softmax(logits * 2, -1), *args)
        return out if alone else post(out)

    x = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)  # noqa: E731
    w = 1 + 0.1 * x(HIDDEN)
    rows = lambda n: torch.full((SAMPLING_ROWS,), n, device=DEVICE)  # noqa: E731
    gating = torch.randn(t, 256, device=DEVICE) * 2
    sampling_args = (torch.randn(SAMPLING_ROWS, VOCAB, device=DEVICE),)
    seed, offset = torch.tensor(42, device=DEVICE), torch.tensor(0, device=DEVICE)  # 0-d int64, as the op takes
    return {
        "rmsnorm": ((x(t, HIDDEN), w, 1e-6), simple(), norm.rmsnorm),
        "gemma_rmsnorm": ((x(t, HIDDEN), w, 1e-6), simple(), norm.gemma_rmsnorm),
        "fused_add_rmsnorm": ((x(t, HIDDEN), x(t, HIDDEN), w, 1e-6), in_place((0, 1)), norm.fused_add_rmsnorm),
        "gemma_fused_add_rmsnorm": ((x(t, HIDDEN), x(t, HIDDEN), w, 1e-6), in_place((0, 1)), norm.gemma_fused_add_rmsnorm),
        "silu_and_mul": ((x(t, 2 * INTERMEDIATE),), simple(), activation.silu_and_mul),
        "gelu_and_mul": ((x(t, 2 * INTERMEDIATE), "none"), simple(), activation.gelu_and_mul),
        "gelu_tanh_and_mul": ((x(t, 2 * INTERMEDIATE),), simple(), activation.gelu_tanh_and_mul),
        "rotary_embedding": ((torch.randint(0, 8192, (t,), device=DEVICE), x(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
                              make_cos_sin_cache(8192, HEAD_DIM, 500000.0, device=DEVICE)), qkv_rope, rope.rotary_embedding),
        "per_token_group_quant_fp8": ((x(t, HIDDEN), 128, 1e-10, False, False), simple(), quant.per_token_group_quant_fp8),
        "topk_softmax": ((gating, 8, True), simple(), moe.topk_softmax),
        "grouped_topk": ((gating, 8, True, 8, 4, "sigmoid", torch.randn(256, device=DEVICE) * 0.1, 2.5), simple(),
                         moe.grouped_topk),
        "merge_attn_states": ((x(t, HEADS, HEAD_DIM), torch.randn(t, HEADS, device=DEVICE), x(t, HEADS, HEAD_DIM),
                               torch.randn(t, HEADS, device=DEVICE)), simple(), attention.merge_attn_states),
        "top_k_renorm_probs": ((*sampling_args, rows(50)), sampled, sampling.top_k_renorm_probs),
        "top_p_renorm_probs": ((*sampling_args, rows(0.9)), sampled, sampling.top_p_renorm_probs),
        "top_k_top_p_sampling_from_probs": ((*sampling_args, rows(50), rows(0.9), seed, offset), sampled,
                                            sampling.top_k_top_p_sampling_from_probs),
    }


def _fresh(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _check(got, want, what: str) -> None:
    """Sanity before timing: every output within 2% (relative Frobenius norm) of ours in eager mode
    (the op tests check the numbers; this catches a route computing something else)."""
    for g, w in zip(got, want):
        err = decoder_layer.relative_error(g.float(), w.float())
        if not err < 2e-2:
            raise AssertionError(f"{what}: relative error {err:.3g} against eager")


def _select(route=None, op=None) -> None:
    """``route`` for ``op`` (or every op); ``inductor_triton`` with Triton selected, since that route
    launches the Triton kernel."""
    spec = None if route is None else (route if op is None else {op: route})
    torch_kernels.configure(compile_route=spec, backend="triton" if route == registry.INDUCTOR_TRITON else None)
    torch._dynamo.reset()


def bench_ops(t: int, names) -> list:
    cases, results = _ops(t), []
    for name, (args, block, reference) in cases.items():
        if names and name not in names:
            continue
        op = getattr(torch.ops.deepinfer, name).default
        for kind in ("block", "alone"):
            alone = kind == "alone"
            _select()
            want = block(op, *_fresh(args), alone=alone)
            row = {"op": name, "kind": kind, "tokens": t, "default route": registry.COMPILE_ROUTE[name],
                   "opaque serves": dispatch.plan(name)[0][0].backend.value}
            eager_args = _fresh(args)
            row["eager"] = harness.graph_us(lambda: block(op, *eager_args, alone=alone))
            # "measured": no route forced, so the op's own choice (DECOMPOSE_AFTER_POINTWISE included).
            # inductor_triton last: a failure there that breaks the CUDA context (an illegal address
            # as one once did in the rope block) leaves the other figures standing
            routes = sorted(registry.compile_routes(name), key=lambda r: r == registry.INDUCTOR_TRITON)
            variants = [("plain", None, reference), ("measured", None, op)] + [(r, r, op) for r in routes]
            for label, route, fn in variants:
                _select(route, name if route else None)
                compiled = torch.compile(lambda *a, fn=fn: block(fn, *a, alone=alone), fullgraph=True, dynamic=False)
                try:
                    call_args = _fresh(args)
                    _check(compiled(*call_args), want, f"{name} {kind} {label}")
                    row[label] = harness.graph_us(lambda: compiled(*call_args))
                    torch.cuda.synchronize()  # an asynchronous failure is this variant's
                except Exception as e:  # e.g. Inductor failing on the sampling reference: reported, not fatal
                    row[label] = None
                    row[f"{label} error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            _select()
            results.append(row)
            print(f"{name:32s} {kind:5s}", "  ".join(f"{k} {row[k]:.1f}" if row.get(k) is not None else f"{k} -"
                                                    for k in ("plain", "measured", *registry.COMPILE_ROUTES, "eager")), flush=True)
            for key in (k for k in row if k.endswith(" error")):
                print(f"    {key}: {row[key]}", flush=True)
    _select()
    return results


def bench_layer(tokens) -> list:
    cfg, results = decoder_layer.LLAMA_8B, []
    ours, plain = (decoder_layer.DecoderLayer(cfg, flag, DEVICE, torch.bfloat16) for flag in (True, False))
    for t in tokens:
        positions, hidden = decoder_layer.inputs(cfg, t, DEVICE, torch.bfloat16)
        with torch.inference_mode():
            want = plain(positions, hidden)
            for name, layer in (("ours", ours), ("plain", plain)):
                _select()
                row = {"layer": name, "tokens": t}
                _check(layer(positions, hidden), want, f"layer {name} eager")
                row["eager us"] = harness.events_us(lambda: layer(positions, hidden))
                row["eager device us"] = harness.graph_us(lambda: layer(positions, hidden))
                compiled = torch.compile(layer, fullgraph=True, dynamic=False)
                _check(compiled(positions, hidden), want, f"layer {name} compiled")
                row["compiled us"] = harness.events_us(lambda: compiled(positions, hidden))
                row["compiled device us"] = harness.graph_us(lambda: compiled(positions, hidden))
                torch._dynamo.reset()
                graphed = torch.compile(layer, mode="reduce-overhead", fullgraph=True, dynamic=False)
                for _ in range(3):  # warm-up, record, replay
                    _check([o.clone() for o in graphed(positions, hidden)], want, f"layer {name} reduce-overhead")
                row["reduce-overhead us"] = harness.events_us(lambda: graphed(positions, hidden))
                if name == "ours":
                    for route in registry.COMPILE_ROUTES:
                        _select(route)
                        forced = torch.compile(layer, fullgraph=True, dynamic=False)
                        _check(forced(positions, hidden), want, f"layer ours compiled, every op {route}")
                        row[f"compiled device us, all {route}"] = harness.graph_us(lambda: forced(positions, hidden))
                results.append(row)
                print(row, flush=True)
    _select()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the op blocks")
    parser.add_argument("--layer-tokens", default="1,32,4096", help="token counts of the decoder layer ('' for none)")
    parser.add_argument("--ops", default="", help="comma-separated ops (default: all; 'none' for none)")
    args = parser.parse_args()
    torch.manual_seed(0)
    names = [] if not args.ops else args.ops.split(",")
    ops = [] if names == ["none"] else bench_ops(args.tokens, names)
    layer = bench_layer([int(t) for t in args.layer_tokens.split(",") if t])
    result = {**harness.header(), "routes": dict(registry.COMPILE_ROUTE), "ops": ops, "decoder_layer": layer}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{result['gpu']}  torch {result['versions']['torch']}  triton {result['versions']['triton']}\n")
    if ops:
        print(harness.markdown(ops, ["op", "kind", "default route", "opaque serves", "plain", *registry.COMPILE_ROUTES, "eager"]))
        print()
    if layer:
        print(harness.markdown(layer, ["layer", "tokens", "eager us", "compiled us", "reduce-overhead us", "eager device us",
                                       "compiled device us", *(f"compiled device us, all {r}" for r in registry.COMPILE_ROUTES)]))


if __name__ == "__main__":
    main()
