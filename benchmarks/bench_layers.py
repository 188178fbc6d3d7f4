"""Whole decoder layers on our ops against the same layers in plain torch, in each mode a serving engine
runs them: eager, compiled (``torch.compile``, fullgraph, static shapes) and reduce-overhead (compiled
into CUDA graphs), at 1, 32 and 2048 tokens (Llama-3-8B shapes, bf16).

    python benchmarks/bench_layers.py --out docs/benchmarks/layers   # layers.json, layers.md, layers.png
    python benchmarks/bench_layers.py --device cpu --tiny --modes eager,compiled --out /tmp/layers  # smoke

Layers, each from ``examples/`` with ours and plain over the same weights:

* ``llama``: ``decoder_layer.py``;
* ``fp8``: ``fp8_decoder_layer.py``, FP8 weights and per-token FP8 activations into ``torch._scaled_mm``
  (ours: the fused norm and activation quant ops);
* ``paged`` and ``paged qk-norm``: ``paged_decoder_layer.py``, the keys and values written into a paged
  cache (block 16) and read back for SDPA (ours: the fused rope + cache write, and with QK-norm the fused
  QK-norm + RoPE); the caches are marked static addresses, as engines hold them.

Each (layer, tokens, mode) runs ours and plain, each checked against plain eager first (relative error
below the layer's tolerance), then timed: ``wall us``, µs per call over back-to-back calls between two CUDA
events (the host included: what a caller without CUDA graphs pays), and ``device us``, the same call
replayed from a CUDA graph (eager and compiled; reduce-overhead replays graphs already). The goals of
the whole-layer issue are judged per layer and token count: ours compiled at most plain compiled, ours
eager at most 1.2x plain compiled at 1 and 32 tokens, ours reduce-overhead at most plain's. ``--profile``
adds, per call, our ops' host µs and the costliest calls inside them, the copies made outside them
(Inductor's around in-place ops among them), the costliest other outermost aten ops, on CUDA the kernels
launched, and the calls the C++ entry served and passed on to Python (eager against compiled: whether
compiled code reaches it). On the CPU
only the wall clock is taken, which says nothing of a GPU, and no goal is judged.
"""

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import decoder_layer  # noqa: E402
import fp8_decoder_layer as fp8  # noqa: E402
import paged_decoder_layer as paged  # noqa: E402
from torch_kernels.bench import harness  # noqa: E402

LAYERS = ("llama", "fp8", "paged", "paged qk-norm")
MODES = ("eager", "compiled", "reduce-overhead")
IMPLS = ("ours", "plain")
#: relative error of ours against plain, per output: bf16 roundings (the cacheless layer's check in
#: bench_compile), and for FP8 a quantisation moving values a whole e4m3 step (fp8_decoder_layer's)
TOLERANCE = {"llama": (2e-2, 2e-2), "fp8": fp8.PLAIN_TOLERANCE, "paged": (3e-2, 3e-2), "paged qk-norm": (3e-2, 3e-2)}
#: (mode of ours, mode of plain, the most ours / plain may be, token counts it is asked at: None for all)
GOALS = (("compiled", "compiled", 1.0, None), ("eager", "compiled", 1.2, (1, 32)),
         ("reduce-overhead", "reduce-overhead", 1.0, None))


def layer_pair(layer: str, cfg, tokens: int, device: str, dtype) -> dict:
    """``{impl: (module, args)}`` of ``layer`` at ``tokens`` tokens: ours and plain over the same weights
    and inputs (each paged impl with caches of its own)."""
    if layer == "llama":
        args = decoder_layer.inputs(cfg, tokens, device, dtype)
        return {impl: (decoder_layer.DecoderLayer(cfg, impl == "ours", device, dtype), args) for impl in IMPLS}
    if layer == "fp8":
        layers, args = fp8.build(cfg, device, dtype), decoder_layer.inputs(cfg, tokens, device, dtype)
        return {"ours": (layers["fused"], args), "plain": (layers["plain"], args)}
    num_blocks = 2 * -(-tokens // paged.BLOCK_SIZE)
    positions, hidden, slot_mapping = paged.paged_inputs(cfg, tokens, num_blocks, device, dtype)
    layers = paged.build(cfg, device, dtype, qk_norm=layer == "paged qk-norm")
    pair = {}
    for impl, variant in (("ours", "fused"), ("plain", "plain")):
        caches = layers[variant].new_caches(num_blocks, torch.Generator().manual_seed(7))
        for cache in caches:  # engines keep caches at fixed addresses (vLLM marks them so)
            torch._dynamo.mark_static_address(cache)
        pair[impl] = (layers[variant], (positions, hidden, *caches, slot_mapping))
    return pair


def callable_in(mode: str, module):
    if mode == "eager":
        return module
    if mode == "compiled":
        return torch.compile(module, fullgraph=True, dynamic=False)
    return torch.compile(module, mode="reduce-overhead", fullgraph=True, dynamic=False)


def _check(layer: str, got, want, what: str) -> None:
    for g, w, bound in zip(got, want, TOLERANCE[layer]):
        err = decoder_layer.relative_error(g, w)
        if not err < bound:
            raise AssertionError(f"{what}: relative error {err:.3g} against plain eager (bound {bound})")


def rows_at(layer: str, cfg, tokens: int, modes, device: str, dtype, profile: bool = False) -> list:
    """One row per (impl, mode): ours checked against plain eager, then both timed (and profiled)."""
    from torch._dynamo.utils import counters

    pair = layer_pair(layer, cfg, tokens, device, dtype)
    plain, plain_args = pair["plain"]
    want = [t.clone() for t in plain(*plain_args)]
    rows = []
    for mode in modes:
        for impl, (module, args) in pair.items():
            torch._dynamo.reset()
            skips = counters["inductor"]["cudagraph_skips"]
            fn = callable_in(mode, module)
            for _ in range(3 if mode == "reduce-overhead" else 1):  # warm-up, record, replay
                got = [t.clone() for t in fn(*args)]
            _check(layer, got, want, f"{layer} {tokens} tokens, {impl} {mode}")
            row = {"layer": layer, "tokens": tokens, "impl": impl, "mode": mode}
            if counters["inductor"]["cudagraph_skips"] > skips:
                row["note"] = "Inductor skipped its CUDA graphs"
            if device == "cuda":
                row["wall us"] = harness.events_us(lambda: fn(*args))
                if mode != "reduce-overhead":
                    row["device us"] = harness.graph_us(lambda: fn(*args))
            else:
                row["wall us"] = harness.wall_us(lambda: fn(*args), min_s=1e-3, repeat=3)
            if profile:
                row["profile"] = profile_of(lambda: fn(*args), cuda=device == "cuda")
            rows.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items() if k != "profile"}, flush=True)
    torch._dynamo.reset()
    return rows


#: the ops a copy is made by, counted where no op of ours and no other copy made them
COPIES = ("aten::copy_", "aten::clone", "aten::_to_copy")


def _under(event, prefixes) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.cpu_parent
    return False


def profile_of(fn, calls: int = 5, cuda: bool = False) -> dict:
    """What separates the columns, per call of ``fn``: our ops called and each one's host µs (inclusive),
    the costliest calls directly inside them (on a GPU the CUDA runtime's and driver's: a launch, an
    allocation, or a wait that would explain an op slower in compiled code than eager), the copies made
    outside our ops (Inductor's around in-place ops among them), the host µs of the costliest other
    outermost aten ops, on CUDA the kernels launched (copies and memsets included), and the calls the C++
    entry served and passed on to Python (where it is loaded)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from torch_kernels import fast_path

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    entry = fast_path.counters()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    entry = {k: (v - entry[k]) / calls for k, v in fast_path.counters().items() if k != "signatures"}
    events = prof.events()
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    ours, top, copies, inside = {}, {}, {}, {}
    for e in cpu:
        if _under(e, ("deepinfer::",)):
            if e.cpu_parent is not None and e.cpu_parent.name.startswith("deepinfer::"):  # a launch, an allocation, a wait
                inside[e.name] = inside.get(e.name, 0.0) + e.cpu_time_total / calls
            continue
        if e.name.startswith("deepinfer::"):
            ours[e.name] = ours.get(e.name, 0.0) + e.cpu_time_total / calls
        elif e.name in COPIES and not _under(e, COPIES):
            copies[e.name] = copies.get(e.name, 0) + 1 / calls
        elif e.name.startswith("aten::") and not _under(e, ("aten::",)):  # the outermost, compiled code's too
            top[e.name] = top.get(e.name, 0.0) + e.cpu_time_total / calls
    out = {"our ops": {k: round(v, 1) for k, v in sorted(ours.items())},
           "inside our ops": dict(sorted(((k, round(v, 1)) for k, v in inside.items()), key=lambda kv: -kv[1])[:4]),
           "copies": {k: round(v, 2) for k, v in sorted(copies.items())},
           "outermost aten host us": dict(sorted(((k, round(v, 1)) for k, v in top.items()), key=lambda kv: -kv[1])[:5])}
    if cuda:
        out["kernels"] = sum(e.device_type == DeviceType.CUDA for e in events) / calls
    if fast_path.loaded():
        out["C++ entry"] = entry
    return out


def _at(rows: list, layer: str, tokens: int, impl: str, mode: str) -> dict:
    return next((r for r in rows if (r["layer"], r["tokens"], r["impl"], r["mode"]) == (layer, tokens, impl, mode)), {})


def summary(rows: list) -> list:
    """One line per (layer, tokens, mode): ours and plain side by side, plain over ours (above 1: ours faster)."""
    out = []
    for layer, tokens, mode in dict.fromkeys((r["layer"], r["tokens"], r["mode"]) for r in rows):
        ours, plain = _at(rows, layer, tokens, "ours", mode), _at(rows, layer, tokens, "plain", mode)
        line = {"layer": layer, "tokens": tokens, "mode": mode}
        for col in ("wall us", "device us"):
            line[f"ours {col}"], line[f"plain {col}"] = ours.get(col), plain.get(col)
            if ours.get(col) and plain.get(col):
                line[f"{col.split()[0]} x plain"] = plain[col] / ours[col]
        line["note"] = "; ".join(f"{impl}: {r['note']}" for impl, r in (("ours", ours), ("plain", plain)) if "note" in r)
        out.append(line)
    return out


def goals(rows: list) -> list:
    """The issue's goals on wall time, per layer and token count where both sides were timed."""
    out = []
    for layer, tokens in dict.fromkeys((r["layer"], r["tokens"]) for r in rows):
        for ours_mode, plain_mode, most, at in GOALS:
            ours, plain = _at(rows, layer, tokens, "ours", ours_mode), _at(rows, layer, tokens, "plain", plain_mode)
            if (at is None or tokens in at) and ours.get("wall us") and plain.get("wall us"):
                ratio = ours["wall us"] / plain["wall us"]
                out.append({"layer": layer, "tokens": tokens, "goal": f"ours {ours_mode} <= {most}x plain {plain_mode}",
                            "ours / plain": ratio, "met": ratio <= most})
    return out


def plot(rows: list, path: Path) -> None:
    """µs against tokens, log axes, a column per layer (wall µs above, CUDA-graph device µs below where
    taken): ours solid, plain dashed, a colour per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(dict.fromkeys(r["layer"] for r in rows))
    cols = [c for c in ("wall us", "device us") if any(r.get(c) for r in rows)]
    fig, axes = plt.subplots(len(cols), len(layers), figsize=(4.5 * len(layers), 4 * len(cols)), squeeze=False)
    for i, col in enumerate(cols):
        for ax, layer in zip(axes[i], layers):
            for color, mode in zip(("tab:blue", "tab:orange", "tab:green"), MODES):
                for impl, style in (("ours", "-"), ("plain", "--")):
                    pts = sorted((r["tokens"], r[col]) for r in rows
                                 if (r["layer"], r["impl"], r["mode"]) == (layer, impl, mode) and r.get(col))
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{impl} {mode}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{layer}: {col.split()[0]}")
            ax.set_xlabel("tokens")
            ax.set_ylabel(f"{col.split()[0]} µs per call")
            ax.grid(True, which="both", alpha=0.3)
        axes[i][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _inline(v):
    return ", ".join(f"{k.split('::')[-1]} {n}" for k, n in v.items()) if isinstance(v, dict) else v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small layers (hidden 64) instead of Llama-3-8B's")
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,32,2048; on the CPU 1,7)")
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--modes", default=None, help=f"comma-separated of {','.join(MODES)} (on the CPU no reduce-overhead)")
    p.add_argument("--profile", action="store_true", help="also profile each row: our ops' host µs, the copies "
                   "made outside them, the costliest other ops, the kernels launched, the C++ entry's calls")
    p.add_argument("--out", default=None, help="folder for layers.json, layers.md and layers.png")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    cfg = decoder_layer.TINY if a.tiny else decoder_layer.LLAMA_8B
    tokens = [int(t) for t in (a.tokens or ("1,32,2048" if cuda else "1,7")).split(",")]
    modes = (a.modes or ",".join(MODES if cuda else MODES[:2])).split(",")
    if not cuda and "reduce-overhead" in modes:
        raise SystemExit("reduce-overhead compiles CUDA graphs: it needs --device cuda")
    torch.manual_seed(0)
    rows = []
    with torch._dynamo.config.patch(recompile_limit=64), torch.inference_mode():
        for layer in a.layers.split(","):
            for t in tokens:
                rows += rows_at(layer, cfg, t, modes, a.device, torch.bfloat16, a.profile)
    header = harness.header() if cuda else {"gpu": None, "versions": harness.versions()}
    judged = goals(rows) if cuda else []
    result = {**header, "device": a.device, "config": dataclasses.asdict(cfg), "rows": rows, "goals": judged}
    table = harness.markdown(summary(rows), ["layer", "tokens", "mode", "ours wall us", "plain wall us", "wall x plain",
                                             "ours device us", "plain device us", "device x plain", "note"])
    text = f"# Decoder layers: ours against plain torch\n\n{result['gpu'] or a.device}, torch {result['versions']['torch']}\n\n"
    text += table + "\n"
    profiled = [{**{k: r[k] for k in ("layer", "tokens", "impl", "mode")}, **{k: _inline(v) for k, v in r["profile"].items()}}
                for r in rows if "profile" in r]
    if profiled:
        text += ("\n## Per call: our ops (host µs), the costliest calls directly inside them (host µs), copies "
                 "outside them, costliest other ops (host µs), kernels, C++ entry calls\n\n")
        text += harness.markdown(profiled, ["layer", "tokens", "impl", "mode", "our ops", "inside our ops", "copies",
                                            "outermost aten host us", "kernels", "C++ entry"]) + "\n"
    if judged:
        text += "\n## Goals (wall µs)\n\n" + harness.markdown(judged, ["layer", "tokens", "goal", "ours / plain", "met"]) + "\n"
    print("\n" + text)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        harness.write_json(out / "layers.json", result)
        (out / "layers.md").write_text(text)
        plot(rows, out / "layers.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
