"""The benchmark's results: the goals judged on the registered op's rows, and the files a run writes
(``<device>.json``, ``<device>.md``, one plot an op). Reads result dicts only; ``suite.py`` measures."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..spec import Backend
from . import cases

#: how a goal names a dtype
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
GOAL_TOKENS, GOAL_COPY = 4096, 0.95  # the goals: >= 1.0x best peer from 4096 tokens, 0.95 of copy
#: Why a run without CUDA judges no goal: they were set for the H200 against its peers there.
GOALS_NOT_JUDGED = "the goals are set for a CUDA GPU; this run is on CPU"
#: the registered op's label in the tables and plots
OP_LABEL = "deepinfer op"
#: the label of what the op calls under DEEPINFER_OPS_BACKEND=auto
AUTO_LABEL = "deepinfer op, auto"
#: auto's contract: never slower than the best single backend by more than this fraction, at any shape
AUTO_SLACK = 0.02
#: the single backends auto is judged against (each called directly)
SINGLE_BACKENDS = tuple(b.value for b in Backend if b is not Backend.TORCH)


def _shape_key(r: dict):
    return (r["hidden"] or 0, r["tokens"])


def goals(rows: List[dict], host_goals: Optional[Dict[str, dict]] = None) -> List[dict]:
    """The issue's goals, judged on the registered op's rows: memory-bound ops (``BenchCase.memory_bound``)
    at least as fast as the best peer from 4096 tokens and at 0.95 of copy at the largest shape; at 1-32
    tokens no slower than the best peer (graph replay); an op's host goal (``BenchCase.host_goal``, as
    rmsnorm 1x4096 host µs no more than F.rms_norm's) judged on its measurement with its backend
    selected (``host_goals[op]``, :func:`host_goal`) or else on the op's rows; where ``auto`` was timed,
    at every shape no slower than the fastest single backend (checked ok) by more than :data:`AUTO_SLACK`."""
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op and r["key"] == "op" and "device_us" in r]

        def worst(sel, what, threshold, value):
            judged = [(value(r), r["shape"]) for r in sel if value(r) is not None]
            if not judged:
                return
            v, at = min(judged)
            out.append({"op": op, "goal": what, "worst": v, "at": at, "met": v >= threshold})

        if cases.case(op).memory_bound:
            worst([r for r in mine if r["tokens"] >= GOAL_TOKENS], f">= 1.0x best peer from {GOAL_TOKENS} tokens",
                  1.0, lambda r: r.get("vs best peer"))
            if mine:
                largest = max(mine, key=lambda r: r["bytes"])
                worst([largest], f">= {GOAL_COPY} of copy at the largest shape", GOAL_COPY, lambda r: r.get("of copy"))
        worst([r for r in mine if r["tokens"] <= 32], "<= best peer's device time at 1-32 tokens", 1.0,
              lambda r: r.get("vs best peer"))
        auto = auto_vs_best_backend(rows, op)
        if auto:
            v, at = min(auto)
            out.append({"op": op, "goal": f"auto within {AUTO_SLACK:.0%} of the best single backend at every shape",
                        "worst": v, "at": at, "met": v >= 1 / (1 + AUTO_SLACK)})
    host_goals = host_goals or {}
    for op in dict.fromkeys([r["op"] for r in rows] + list(host_goals)):
        goal = cases.case(op).host_goal
        if goal is None:
            continue
        label = cases.shape_of(op, goal.tokens, goal.hidden, cases.PROFILES["gpu"])[2]
        host = {r["key"]: r["host_us"] for r in rows if r["op"] == op and r["shape"] == label
                and r["dtype"] == goal.dtype and r.get("host_us") is not None}
        selected, measured = "", host_goals.get(op)
        if measured is not None:
            host, selected = measured, f" ({measured['backend']} selected, C++ entry {measured['cpp_entry']})"
        if "op" in host and goal.peer in host:
            ours, peer = host["op"], host[goal.peer]
            out.append({"op": op, "goal": f"host µs at {label} {SHORT_DTYPE.get(goal.dtype, goal.dtype)} <= {goal.peer}'s",
                        "worst": peer / ours, "at": f"op {ours:.1f} µs{selected}, {goal.peer} {peer:.1f} µs",
                        "met": ours <= peer})
    return out


def auto_vs_best_backend(rows: List[dict], op: str) -> List[Tuple[float, str]]:
    """Per shape where ``op``'s ``auto`` and a single backend were timed: (the fastest single backend's device
    µs over auto's, where): below 1, auto is slower than that backend."""
    out = []
    for a in (r for r in rows if r["op"] == op and r["key"] == "auto" and "device_us" in r):
        singles = [r for r in rows if r["op"] == op and r["shape"] == a["shape"] and r["key"] in SINGLE_BACKENDS
                   and "device_us" in r and str(r.get("check", "")).startswith("ok")]
        if singles:
            best = min(singles, key=lambda r: r["device_us"])
            out.append((best["device_us"] / a["device_us"], f"{a['shape']} (auto {a['device_us']:.3g} µs serves "
                        f"{a.get('serves', '?')}, {best['key']} {best['device_us']:.3g})"))
    return out


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"
    return str(v)


def markdown(result: dict) -> str:
    h, rows = result["header"], result["rows"]
    v = h["versions"]
    lines = [f"# Benchmark suite: {h['device']}", "",
             f"{h['device']}" + (f" (sm_{''.join(map(str, h['compute_capability']))})" if h["compute_capability"] else "")
             + f", {h['date']}; torch {v.get('torch')}, triton {v.get('triton') or '-'}, tilelang {v.get('tilelang') or '-'}, "
             f"flashinfer {v.get('flashinfer-python') or '-'}; data {h['dtype']}; copy ceiling "
             f"{h['copy_ceiling_GBps']:.0f} GB/s; L2 {'cold' if h['cold_l2'] else 'warm'}.", "",
             f"`{h['command']}` — device time: {h['timing']}; host µs per eager call: {h['host_timing']}; "
             f"{h['compile']}; {h['mode']}. GB/s: bytes each tensor read or written once, over device time; "
             "`vs best peer`: the fastest peer's device time over this row's (above 1: faster than every peer).", ""]
    if result.get("not_run"):
        lines += [f"Not run (budget): {', '.join(result['not_run'])}", ""]
    if result.get("not_benchmarked"):
        lines += [f"Not benchmarked (no bench case in its definition): {', '.join(result['not_benchmarked'])}", ""]
    if h["gpu"] is None:
        lines += [f"Goals: not judged: {GOALS_NOT_JUDGED}.", ""]
    elif result["goals"]:
        lines += ["## Goals (registered op)", "", "| op | goal | worst | at | met |", "|---|---|---|---|---|"]
        lines += [f"| {g['op']} | {g['goal']} | {_fmt(g['worst'])} | {g['at']} | {'yes' if g['met'] else '**no**'} |"
                  for g in result["goals"]]
        lines.append("")
    if result["failures"]:
        lines += ["## Failures of our implementations", ""] + [f"* {f}" for f in result["failures"]] + [""]
    for op in dict.fromkeys(r["op"] for r in rows):
        op_rows = [r for r in rows if r["op"] == op]
        timed = sorted((r for r in op_rows if "device_us" in r), key=lambda r: (_shape_key(r), r["device_us"]))
        lines += [f"## {op} ({op_rows[0]['dtype']})", "",
                  "| shape | impl | device µs | host µs | GB/s | of copy | vs best peer | note |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in timed:
            note = "; ".join(x for x in (f"serves {r['serves']}" if "serves" in r else "",
                                         "" if r.get("check") == "ok" else r.get("check", ""),
                                         "" if r["timing"].startswith("graph") or r["timing"] == "wall clock" else r["timing"],
                                         r.get("status", "")) if x)
            label = f"**{r['impl']}**" if r["key"] in ("op", "auto") else r["impl"] + (" (peer)" if r["role"] == "peer" else "")
            lines.append(f"| {r['shape']} | {label} | {_fmt(r['device_us'])} | {_fmt(r.get('host_us'))} | {_fmt(r['GB/s'], 4)} "
                         f"| {_fmt(r['of copy'])} | {_fmt(r['vs best peer'])} | {note} |")
        untimed: Dict[Tuple[str, str], List[str]] = {}
        for r in op_rows:
            if "device_us" not in r:
                untimed.setdefault((r["impl"], r["status"]), []).append(r["shape"])
        if untimed:
            lines.append("")
            lines += [f"* not timed: {impl}, {status} ({len(shapes)} shape{'s' * (len(shapes) > 1)}: {', '.join(shapes[:4])}"
                      f"{', ...' if len(shapes) > 4 else ''})" for (impl, status), shapes in untimed.items()]
        lines.append("")
    unusable: Dict[Tuple[str, str], List[str]] = {}
    for op, per in (h.get("unavailable") or {}).items():
        for backend, why in per.items():
            unusable.setdefault((backend, why), []).append(op)
    if unusable:
        lines += ["Backends not usable here: " + "; ".join(f"{b} ({why}): {', '.join(o)}"
                                                         for (b, why), o in unusable.items()), ""]
    return "\n".join(lines)


#: the plots' rows: what each draws of a row, its y label, and whether its y axis is logarithmic
PLOT_ROWS = (("device_us", "device µs (log)", True), ("vs best peer", "best peer µs / µs", False), ("GB/s", "GB/s", False))


def plot(result: dict, folder: Path) -> List[Path]:
    """One PNG per op, one column per hidden size, tokens on a log x axis: device µs on a log y axis (every
    size, the small and middle ones legible), the best peer's time over each implementation's (below the
    line at 1, behind the fastest peer: a loss seen at a glance), and GB/s against the copy ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, paths = result["header"], []
    folder.mkdir(parents=True, exist_ok=True)
    for op in dict.fromkeys(r["op"] for r in result["rows"]):
        timed = [r for r in result["rows"] if r["op"] == op and "device_us" in r]
        if not timed:
            continue
        panels = sorted({r["hidden"] for r in timed}, key=lambda x: x or 0)
        fig, axes = plt.subplots(len(PLOT_ROWS), len(panels), figsize=(4.6 * len(panels), 3.0 * len(PLOT_ROWS)),
                                 squeeze=False, sharex="col")
        for col, hidden in enumerate(panels):
            sel = [r for r in timed if r["hidden"] == hidden]
            ticks = sorted({r["tokens"] for r in sel})
            for (field, ylabel, log_y), ax in zip(PLOT_ROWS, axes[:, col]):
                for label in dict.fromkeys(r["impl"] for r in sel):
                    pts = sorted((r["tokens"], r[field]) for r in sel if r["impl"] == label and r.get(field))
                    if not pts:
                        continue
                    peer = next(r["role"] == "peer" for r in sel if r["impl"] == label)
                    ax.plot(*zip(*pts), marker="o", markersize=3, linestyle="--" if peer else "-",
                            linewidth=2.2 if label in (OP_LABEL, AUTO_LABEL) else 1.2, label=label)
                if field == "GB/s" and h["copy_ceiling_GBps"]:
                    ax.axhline(h["copy_ceiling_GBps"], color="grey", linestyle=":", linewidth=1, label="copy")
                if field == "vs best peer":
                    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
                if log_y:
                    ax.set_yscale("log")
                ax.set_xscale("log", base=2)
                ax.set_xticks(ticks, [str(t) for t in ticks])
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3, which="both" if log_y else "major")
            axes[-1][col].set_xlabel(cases.case(op).axis)
            axes[0][col].set_title(sel[0]["shape"].split("x", 1)[1] if hidden is None else f"hidden {hidden}", fontsize=9)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{op} ({timed[0]['dtype']}) — {h['device']}, {h['date']}", fontsize=10)
        fig.tight_layout()
        path = folder / f"{op}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def slug(device: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device.split(" (")[0].lower()).strip("-") or "device"


def write(result: dict, out: Path, plots: bool) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = slug(result["header"]["device"])
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    paths[1].write_text(markdown(result))
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("[bench] matplotlib is not installed: wrote the tables, skipped the plots (pip install matplotlib)",
                  file=sys.stderr)
        else:
            paths += plot(result, out / name)
    return paths
