"""``python -m torch_kernels tune``: time every usable backend of every op over the benchmark's shape
buckets on this GPU, and store the winners (``torch_kernels/tuning.py``) for ``DEEPINFER_OPS_BACKEND=auto``.

The measurement is the benchmark suite's (``torch_kernels/bench/suite.py``: each backend checked against the
reference, then device µs by CUDA-graph replay) restricted to our backends, once per ``--dtypes`` entry.
Per bucket (op, dtype, width, rows of the data argument) the fastest backend wins, unless the platform
default's own backend for that call is within ``tuning.MIN_GAIN`` of it (the run-to-run spread), or the
backend draws from its own random stream (``registry.OWN_RANDOM_STREAM``: auto never changes an op's
samples). Each entry records the fingerprint of every backend timed (``torch_kernels/fingerprints.py``), by
which ``auto`` ignores it once that kernel changes. The measurements are written under ``--out`` as the suite writes them, the winners merged into
the table (``--table``, default the user's table for this GPU).

    python -m torch_kernels tune [--ops rmsnorm,silu_and_mul] [--shapes full|quick|1,32,4096x8192]
        [--dtypes bfloat16,float16] [--budget S] [--table PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

from .. import registry, tuning
from ..spec import Backend, Platform
from . import default_out, report, suite

BACKEND_KEYS = tuple(b.value for b in Backend if b is not Backend.TORCH)


def winners(result: dict) -> List[dict]:
    """One table entry per bucket measured in ``result`` (a suite result of our backends)."""
    chains: Dict[str, List[str]] = result["header"]["cuda_key_serves"] or {}
    own_stream = {(op, b.value) for op, b in registry.OWN_RANDOM_STREAM}
    timed: Dict[Tuple, Dict[str, float]] = {}
    for r in result["rows"]:
        if r["key"] in BACKEND_KEYS and "device_us" in r and str(r.get("check", "")).startswith("ok"):
            dtype, width, rows = r["bucket"]
            timed.setdefault((r["op"], dtype, width, rows), {})[r["key"]] = r["device_us"]
    out = []
    for (op, dtype, width, rows), us in timed.items():
        default = next((b for b in chains.get(op, ()) if b in us), None)
        if default is None:  # the default chain ends in the reference, which is not tuned against
            continue
        candidates = {b: t for b, t in us.items() if (op, b) not in own_stream or b == default}
        best = min(candidates, key=candidates.get)
        winner = default if candidates[default] <= candidates[best] * (1 + tuning.MIN_GAIN) else best
        out.append({"op": op, "dtype": dtype, "width": width, "rows": rows, "winner": winner, "default": default,
                    "us": {b: round(t, 3) for b, t in sorted(us.items())},
                    "fingerprints": {b: tuning.current_fingerprint(op, b) for b in sorted(us)
                                     if Backend(b) in registry.BY_OP[op]}})
    return out


def winners_table(entries: List[dict]) -> str:
    lines = ["| op | dtype | width | rows | winner | platform default | default µs / winner µs | µs per backend |",
             "|---|---|---|---|---|---|---|---|"]
    for e in sorted(entries, key=lambda e: (e["op"], e["dtype"], e["width"], e["rows"])):
        gain = e["us"][e["default"]] / e["us"][e["winner"]]
        lines.append(f"| {e['op']} | {e['dtype']} | {e['width']} | {e['rows']} | {e['winner']} | {e['default']} | "
                     f"{gain:.3f} | " + ", ".join(f"{b} {t:.2f}" for b, t in e["us"].items()) + " |")
    return "\n".join(lines)


class LookupCost(NamedTuple):
    auto_us: float  # a call under auto, the best of the rounds
    bare_us: float  # the same wrapper without the lookup, the best of the rounds
    added_ratio: float  # the median over rounds of (auto - bare) / bare, both timed in the same round


def lookup_cost_us(rounds: int = 31) -> LookupCost:
    """µs a call of the CUDA entry's function under auto (``tuning.auto_call``, over a do-nothing kernel)
    and of the same wrapper without the bucket lookup, on shapes seen before, as in a serving loop, in
    short interleaved rounds. (The platform default's own per-call path is a wrapper too: a dtype check.)
    The ratio is taken within each round, so that a burst of load on a shared machine, which slows one
    round, moves it less than it moves either best: a 2-core CI run's bests gave 0.88 against 0.22 µs
    (3.0 bare calls added) where the rounds on the same machine give 1.9-2.0."""
    import statistics
    import timeit

    import torch

    # the table must name a real op with a Triton backend; the kernel does nothing whatever the op
    op = next(op for op in registry.OPS if Backend.TRITON in registry.BY_OP[op])
    prints = {"triton": tuning.current_fingerprint(op, "triton")}  # fresh entries: the lookup a tuned GPU makes
    entries = [{"op": op, "dtype": "bfloat16", "width": w, "rows": t, "winner": "triton", "fingerprints": prints}
               for w in (4096, 7168, 8192) for t in (1, 32, 512, 4096, 16384)]
    table = tuning.Table.from_json({"schema": tuning.SCHEMA, "key": {}, "entries": entries})
    kernel = lambda x, w, eps: None  # noqa: E731
    auto = tuning.auto_call(table, op, 0, {Backend.TRITON: (kernel, lambda args: kernel)}, kernel,
                            lambda backend, bucket: None)

    def without_lookup(*args):
        x = args[0]  # noqa: F841  (as auto reads its data argument)
        return kernel(*args)

    w = torch.empty(4096, dtype=torch.bfloat16)
    xs = [torch.empty(t, 4096, dtype=torch.bfloat16) for t in (1, 7, 300, 5000)]
    for x in xs:
        auto(x, w, 1e-6)
    def per_call_us(fn) -> float:
        return timeit.timeit(lambda: [fn(x, w, 1e-6) for x in xs], number=500) / 2000 * 1e6

    timed = [(per_call_us(auto), per_call_us(without_lookup)) for _ in range(rounds)]
    return LookupCost(min(a for a, _ in timed), min(b for _, b in timed),
                      statistics.median((a - b) / b for a, b in timed))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kernels tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", help="comma list (default: every op)")
    parser.add_argument("--shapes", default="full", help="as for bench: full (default), quick, or 1,32,4096x8192")
    parser.add_argument("--dtypes", default="bfloat16", help="comma list of data dtypes (default: bfloat16)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run: ops past it are not tuned")
    parser.add_argument("--table", type=Path, help="table file to merge the winners into (default: the user's "
                                                   f"table for this GPU under ${tuning.ENV_TUNE_DIR} or ~/.cache)")
    parser.add_argument("--out", type=Path, help="folder for the measurements (default: docs/benchmarks/tune of a "
                                                 "source checkout, else torch_kernels_bench/tune here)")
    args = parser.parse_args(argv)
    args.out = args.out or default_out("tune")
    platform = Platform.detect()
    if not platform.is_cuda:
        print("python -m torch_kernels tune measures CUDA kernels: this machine has no CUDA GPU", file=sys.stderr)
        return 2
    start, entries, rc = time.monotonic(), [], 0
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        left = None if args.budget is None else max(args.budget - (time.monotonic() - start), 0.0)
        out = args.out / dtype
        bench_argv = ["--backends", ",".join(BACKEND_KEYS), "--shapes", args.shapes, "--dtype", dtype,
                      "--host-tokens", "0", "--no-plots", "--out", str(out)] + (["--ops", args.ops] if args.ops else []) \
            + ([] if left is None else ["--budget", str(left)])
        rc |= suite.main(bench_argv)
        result = json.loads((out / f"{report.slug(platform.device_name)}.json").read_text())
        entries += winners(result)
    path = args.table or tuning.user_dir() / tuning.file_name(platform)
    table = tuning.save(entries, tuning.table_key(platform), path)
    text = winners_table(entries)
    (args.out / "winners.md").write_text(text + "\n")
    print(text)
    cost = lookup_cost_us()
    print(f"[tune] {len(entries)} buckets measured; table {path} now holds {len(table.entries)}; the bucket lookup "
          f"adds {cost.auto_us - cost.bare_us:.2f} µs a call ({cost.auto_us:.2f} against {cost.bare_us:.2f})",
          file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
