"""The sampling family on a CUDA GPU: exactness at the benchmark shapes, then µs by CUDA-graph
replay beside the peers in the same run: FlashInfer's ``top_k_top_p_sampling_from_probs`` (115 µs for the
sampling case on an H200) and torch sort + multinomial (1172 µs there) for the sampling
cases; torch.compile of the reference for the main case only (each compile costs tens of seconds: the
whole run must stay within two minutes); the eager reference. ``--sweep`` also times the Triton
kernel's launch alternatives (buffer and warps; the renormalised row's write; the split prepass's group
maxima; the histogram route's buckets and levels).

FlashInfer is called only through its sampling JIT module (the one saved for the host): see
``_flashinfer``.

Cases, 64 x 128256 fp32 probabilities (softmax of random logits, the Llama-3 vocabulary):
``top_k_top_p_sampling_from_probs`` with top_k 50 and top_p 0.9 per row (target: within 1.5x of
FlashInfer) and with top-k off (top_p 0.9 alone: the full-pass route), ``top_k_renorm_probs`` k=50,
``top_p_renorm_probs`` p=0.9, and one row (decode of one sequence). GB/s counts one read of the probs
(and the write of the renormalised rows) over the time: a floor on the traffic, not its measure.

Checks: the Triton kernel's ids equal the reference's exactly; FlashInfer's ids (another random
stream) lie in the reference's kept set; renormalised rows match within fp32 tolerance.

    python benchmarks/bench_sampling.py --out docs/benchmarks/sampling.json [--sweep]
    python benchmarks/bench_sampling.py --prepass-sweep --out results/sampling_prepass_sweep.json

``--prepass-sweep`` times only ``top_k_renorm_probs`` at 1, 32 and 64 rows under the split prepass's
launch alternatives (``PREPASS_VARIANTS``), FlashInfer's in the same interleaved rounds.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from torch_kernels import dispatch  # noqa: E402  (imports the package: registers the ops)
from torch_kernels.families.sampling import reference as reference  # noqa: E402
from torch_kernels.families.sampling import triton as triton_sampling  # noqa: E402
from torch_kernels.families.sampling.ops import flashinfer_peers, kept_set  # noqa: E402
from torch_kernels.testing import assert_close  # noqa: E402

try:
    import flashinfer
    import flashinfer.sampling
except Exception as e:  # reported in the results
    flashinfer, FLASHINFER_ERROR = None, repr(e)
else:
    FLASHINFER_ERROR = None

BATCH, VOCAB, TOP_K, TOP_P = 64, 128256, 50, 0.9
OPS = ("top_k_top_p_sampling_from_probs", "top_k_renorm_probs", "top_p_renorm_probs")


def _probs(rows):
    return torch.softmax(torch.randn(rows, VOCAB, device="cuda") * 3, -1)


def cases():
    """(name, op, args)."""
    probs = _probs(BATCH)
    k = torch.full((BATCH,), TOP_K, dtype=torch.int32, device="cuda")
    p = torch.full((BATCH,), TOP_P, device="cuda")
    seed, offset = torch.tensor(1234, device="cuda"), torch.tensor(0, device="cuda")
    one = _probs(1)
    return [
        (f"sample {BATCH}x{VOCAB} k={TOP_K} p={TOP_P}", OPS[0], (probs, k, p, seed, offset)),
        (f"sample {BATCH}x{VOCAB} k=off p={TOP_P}", OPS[0], (probs, torch.zeros_like(k), p, seed, offset)),
        (f"sample 1x{VOCAB} k={TOP_K} p={TOP_P}", OPS[0], (one, k[:1], p[:1], seed, offset)),
        (f"top_k_renorm {BATCH}x{VOCAB} k={TOP_K}", OPS[1], (probs, k)),
        (f"top_p_renorm {BATCH}x{VOCAB} p={TOP_P}", OPS[2], (probs, p)),
    ]


def _flashinfer(op, args) -> dict:
    """FlashInfer's peers of a case (``families/sampling/ops.py:flashinfer_peers``): {name: callable, or a string saying
    why there is none}."""
    return {name: peer if isinstance(peer, str) else (lambda fn=peer.fn: fn(*args))
            for name, peer in flashinfer_peers(op, args).items()}


def torch_sort_multinomial(probs, top_k, top_p):
    """The plain-torch peer (vLLM's fallback shape): sort, mask by rank and cumulative mass, renormalise,
    torch.multinomial."""
    sorted_p, idx = probs.sort(-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)
    k = torch.where(top_k > 0, top_k, probs.shape[1]).unsqueeze(-1)
    sorted_p = torch.where(rank < k, sorted_p, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    above = sorted_p.cumsum(-1) - sorted_p
    sorted_p = torch.where(above < top_p.unsqueeze(-1), sorted_p, 0.0)
    choice = torch.multinomial(sorted_p, 1)
    return idx.gather(-1, choice).squeeze(-1).int()


def impls(op, args, main: bool) -> dict:
    """The implementations timed for a case; ``main``: the headline case (torch.compile runs there only)."""
    ref = getattr(reference, op)
    overload = getattr(torch.ops.deepinfer, op).default
    out = {
        "deepinfer op": lambda: overload(*args),
        "triton launcher": lambda: getattr(triton_sampling, op)(*args),
        "eager reference": lambda: ref(*args),
    }
    if main:
        compiled = torch.compile(ref)
        out["torch.compile(reference)"] = lambda: compiled(*args)
    if op == OPS[0]:
        out["torch sort+multinomial"] = lambda: torch_sort_multinomial(*args[:3])
    out.update(_flashinfer(op, args))
    return out


def _check(op, impl, got, want, args) -> str:
    if op == OPS[0]:
        kept = kept_set(*args[:3])
        inside = kept.gather(1, got.long()[:, None]).float().mean().item()
        if impl in ("deepinfer op", "triton launcher", "torch.compile(reference)", "eager reference"):
            assert torch.equal(got, want), f"{impl}: ids differ from the reference"
            return "exact"
        return f"{inside:.0%} in the kept set"
    if impl.startswith("flashinfer"):
        err = (got.float() - want).abs().max().item()
        return "yes" if err < 1e-4 else f"max diff {err:.2g}"
    assert_close(got, want, msg=impl)
    assert torch.equal(got != 0, want != 0), f"{impl}: kept sets differ"
    return "exact set"


def _time(fn) -> tuple:
    """(µs, how): CUDA-graph replay, or plain do_bench if the function cannot be captured."""
    try:
        return harness.graph_us(fn), "graph"
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        import triton.testing
        return triton.testing.do_bench(fn, return_mode="median") * 1e3, f"eager ({type(e).__name__})"


def bench() -> list:
    rows = []
    for i, (name, op, args) in enumerate(cases()):
        want = getattr(reference, op)(*args)
        nbytes = args[0].numel() * 4 * (1 if op == OPS[0] else 2)
        for impl, fn in impls(op, args, main=i == 0).items():
            row = {"case": name, "impl": impl}
            if isinstance(fn, str):
                rows.append({**row, "matches": fn})
                continue
            try:
                row["matches"] = _check(op, impl, fn(), want, args)
                us, how = _time(fn)
            except Exception as e:  # noqa: BLE001  (a peer that fails is reported, not fatal)
                if impl in ("deepinfer op", "triton launcher"):
                    raise
                rows.append({**row, "matches": f"failed: {e!r}"[:160]})
                continue
            rows.append({**row, "us": us, "timing": how, "GB/s": nbytes / us / 1e3})
        fi = [r for r in rows if r["case"] == name and r["impl"] == "flashinfer" and "us" in r]
        ours = [r for r in rows if r["case"] == name and r["impl"] == "deepinfer op"]
        if fi and ours:
            ours[0]["vs flashinfer"] = ours[0]["us"] / fi[0]["us"]
    return rows


def _graph_us_or_error(fn):
    """Graph-replay µs of ``fn``, or the error a launch alternative raised (out of resources: reported)."""
    try:
        return harness.graph_us(fn)
    except Exception as e:  # noqa: BLE001
        return repr(e)[:60]


def sweep() -> list:
    """The sampling kernel at the main case under launch alternatives (buffer, chunk, warps)."""
    name, op, args = cases()[0]
    want = reference.top_k_top_p_sampling_from_probs(*args)
    rows = []
    for cap, chunk, warps in [(4096, 4096, 16), (4096, 4096, 8), (4096, 2048, 8), (2048, 2048, 8), (2048, 2048, 4),
                              (8192, 8192, 16), (4096, 8192, 16), (4096, 4096, 32)]:
        cfg = triton_sampling.Config(cap=cap, chunk=chunk, num_warps=warps, k_small=min(1024, cap // 2))
        fn = lambda: triton_sampling._launch(*args, sample=True, config=cfg)  # noqa: E731
        try:
            assert torch.equal(fn(), want)
            us = harness.graph_us(fn)
        except Exception as e:  # noqa: BLE001  (out of resources: reported)
            us = repr(e)[:60]
        rows.append({"case": name, "cap": cap, "chunk": chunk, "warps": warps, "us": us,
                     "default": "<-" if cfg == triton_sampling.DEFAULT else ""})
    off = cases()[1]
    for chunk_g, np_count, np_mass, warps in [(2048, 16, 8, 16), (1024, 16, 8, 8), (4096, 8, 4, 16), (2048, 32, 16, 16)]:
        cfg = triton_sampling.Config(chunk_g=chunk_g, np_count=np_count, np_mass=np_mass, num_warps=warps)
        fn = lambda: triton_sampling._launch(*off[2], sample=True, config=cfg)  # noqa: E731
        us = _graph_us_or_error(fn)
        rows.append({"case": off[0], "chunk_g": chunk_g, "pivots": f"{np_count}/{np_mass}", "warps": warps, "us": us,
                     "default": "<-" if cfg == triton_sampling.DEFAULT else ""})
    for with_top_k in (True, False):  # the histogram route's launches in a call whose rows all cut at top_k = 50
        cfg = triton_sampling.Config(hist_with_top_k=with_top_k)
        fn = lambda: triton_sampling._launch(*args, sample=True, config=cfg)  # noqa: E731
        rows.append({"case": name, "hist": f"with top-k: {with_top_k}", "us": harness.graph_us(fn),
                     "default": "<-" if cfg == triton_sampling.DEFAULT else ""})
    renorm_k = cases()[3]  # the renormalised row's write (_renorm_write_kernel)
    for block, warps in [(4096, 8), (4096, 4), (2048, 4), (8192, 8), (8192, 16)]:
        cfg = triton_sampling.Config(write_block=block, write_warps=warps)
        fn = lambda: triton_sampling._launch(*renorm_k[2], None, None, None, sample=False, config=cfg)  # noqa: E731
        us = _graph_us_or_error(fn)
        rows.append({"case": renorm_k[0], "write": f"{block}/{warps}w", "us": us,
                     "default": "<-" if cfg == triton_sampling.DEFAULT else ""})
    for group in (8, 4, 16, 0):  # the split prepass's search from group maxima (0: the plain count search)
        cfg = triton_sampling.Config(slice_group=group)
        fn = lambda: triton_sampling._launch(*renorm_k[2], None, None, None, sample=False, config=cfg)  # noqa: E731
        rows.append({"case": renorm_k[0], "write": f"slice groups of {group}", "us": _graph_us_or_error(fn),
                     "default": "<-" if cfg == triton_sampling.DEFAULT else ""})
    renorm_p = cases()[4]  # the histogram route (0 slices: the full-pass route it replaces)
    for slices, buckets, levels, level_oct, warps in [(32, 2048, 8, 2, 8), (32, 512, 8, 2, 8), (32, 2048, 16, 1, 8),
                                                      (32, 2048, 4, 4, 8), (16, 2048, 8, 2, 8), (64, 2048, 8, 2, 4),
                                                      (32, 2048, 8, 2, 4), (0, 2048, 8, 2, 8)]:
        cfg = triton_sampling.Config(hist_slices=slices, hist_buckets=buckets, hist_levels=levels,
                                     hist_level_octaves=level_oct, hist_warps=warps)
        fn = lambda: triton_sampling._launch(renorm_p[2][0], None, renorm_p[2][1], None, None, sample=False,  # noqa: E731
                                             config=cfg)
        us = _graph_us_or_error(fn)
        rows.append({"case": renorm_p[0], "hist": f"{slices}x{buckets} {levels}x{level_oct}oct {warps}w", "us": us,
                     "default": "<-" if cfg == triton_sampling.DEFAULT else ""})
    return rows


#: The split prepass's launch alternatives (``Config`` fields) for ``--prepass-sweep``.
PREPASS_VARIANTS = {"default": {}, "groups of 8": {"slice_group": 8}, "ptxas' registers": {"slice_maxnreg": 0},
                    "56 registers": {"slice_maxnreg": 56}, "8 pivots": {"np_slice": 8},
                    "8 pivots, 56 registers": {"np_slice": 8, "slice_maxnreg": 56}, "groups of 32": {"slice_group": 32}}


def prepass_sweep(rows_list=(1, 32, 64)) -> list:
    """top_k_renorm_probs (k = 50) under the split prepass's launch alternatives, FlashInfer's in the
    same interleaved rounds (``harness.replay_us_interleaved``); every variant checked first."""
    out = []
    for rows in rows_list:
        case = f"top_k_renorm {rows}x{VOCAB}"
        probs = _probs(rows)
        k = torch.full((rows,), TOP_K, dtype=torch.int32, device="cuda")
        want = reference.top_k_renorm_probs(probs, k)
        calls = {}
        for label, fields in PREPASS_VARIANTS.items():
            cfg = triton_sampling.DEFAULT._replace(**fields)
            fn = (lambda cfg=cfg: triton_sampling._launch(probs, k, None, None, None, sample=False, config=cfg))
            try:
                _check(OPS[1], label, fn(), want, (probs, k))
            except Exception as e:  # noqa: BLE001  (out of resources, or wrong: reported)
                out.append({"case": case, "variant": label, "us": f"failed: {e!r}"[:80]})
                continue
            calls[label] = fn
        for name, fn in _flashinfer(OPS[1], (probs, k)).items():
            if not isinstance(fn, str):
                calls[name] = fn
        times, failed = harness.replay_us_interleaved(calls, rounds=5)
        out += [{"case": case, "variant": label, "us": us} for label, us in times.items()]
        out += [{"case": case, "variant": label, "us": f"failed: {e!r}"[:80]} for label, e in failed.items()]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel's launch alternatives")
    parser.add_argument("--prepass-sweep", action="store_true",
                        help="only time top_k_renorm_probs under the split prepass's launch alternatives")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.prepass_sweep:
        swept = prepass_sweep()
        if args.out:
            harness.write_json(args.out, {**harness.header(), "prepass_sweep": swept})
        print(harness.markdown(swept, ["case", "variant", "us"]))
        return
    rows = bench()
    swept = sweep() if args.sweep else None
    result = {**harness.header(), "cuda_key_serves": {op: [k.backend.value for k in dispatch.plan(op)[0]] for op in OPS},
              "flashinfer": FLASHINFER_ERROR, "sampling": rows, "sweep": swept,
              "target": "sampling 64x128256 k=50 p=0.9 within 1.5x of FlashInfer"}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{result['gpu']}  torch {result['versions']['torch']}  CUDA key: {result['cuda_key_serves'][OPS[0]]}\n")
    if swept:
        print(harness.markdown(swept, ["case", "cap", "chunk", "chunk_g", "pivots", "warps", "write", "hist", "us",
                                       "default"]))
        print()
    print(harness.markdown(rows, ["case", "impl", "us", "timing", "GB/s", "vs flashinfer", "matches"]))


if __name__ == "__main__":
    main()
