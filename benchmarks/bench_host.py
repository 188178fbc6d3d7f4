"""Host µs per eager call of every op at one token, as a decode step calls it, beside FlashInfer.

Each op runs at one token (one row; the first hidden size of its bench case) in bf16 with the default
selection, in inference mode (how engines call) and with gradients enabled, in interleaved rounds
against FlashInfer's own API for the same call where it has one. Goals, per op and mode: at most
8 µs a call, and no more than FlashInfer's. A row also says whether the C++ entry served the call
(``python -m torch_kernels build`` first).

    python -m torch_kernels build && python benchmarks/bench_host.py --out results/host.json

On a machine without a CUDA GPU (``--device cpu``) it runs the same calls on the torch reference as a
smoke run and judges no goal.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402,F401  (registers the ops)
from benchmarks import cases, harness  # noqa: E402
from torch_kernels import fast_path, ops  # noqa: E402

#: the goal on every op's host time a call at one token (issue-level target of the C++ entry)
GOAL_US = 8.0
MODES = (("inference_mode", torch.inference_mode), ("grad enabled", torch.enable_grad))


def _flashinfer(op: str, args: tuple):
    """A no-argument call of FlashInfer's API for ``op(*args)``, or why there is none."""
    try:
        peer = cases.flashinfer_api(op, args)
    except Exception as e:  # noqa: BLE001  (reported in the row)
        return f"{type(e).__name__}: {e}"[:120]
    if isinstance(peer, str):
        return peer
    peer_args = peer.prepare(args)
    return lambda: peer.fn(*peer_args)


#: launches a round may leave pending: half of CUDA's queue of about a thousand, past which a launch waits
QUEUED_LAUNCHES = 512


def launches_of(fn) -> int:
    """Kernels one call of ``fn`` launches (copies and memsets included), at least 1."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return max(1, sum(e.device_type == DeviceType.CUDA for e in prof.events()))


def measure(device: str = "cuda", names=None, rounds: int = 20, calls: int = 100, peers: bool = True) -> list:
    """One row per (op, mode): our µs a call, FlashInfer's where it has the op (``peers``), the C++ entry's part."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for op in names or [d.name for d in ops.ALL]:
        if op.startswith("all_reduce_"):  # needs a process group: bench_layers and the collective tests time it
            continue
        args, label = cases.one_token(op, device)
        fn = getattr(torch.ops.deepinfer, op).default
        with torch.inference_mode():
            for _ in range(2):
                fn(*args)  # the first call publishes the signature to the C++ entry
            sync()
        peer = "not asked (--no-peers)" if not peers else _flashinfer(op, args) if device == "cuda" else "not timed off a GPU"
        table = {"ours": lambda: fn(*args)}
        if callable(peer):
            table["flashinfer"] = peer
        # a sampling call launches up to 6 kernels: 100 of them would wait on the queue, not the host
        per_round = {name: max(10, min(calls, QUEUED_LAUNCHES // launches_of(f))) if device == "cuda" else calls
                     for name, f in table.items()}
        for mode, ctx in MODES:
            served = fast_path.counters()["served"] if fast_path.loaded() else 0
            with ctx():
                times = harness.host_us_interleaved(table, rounds, per_round, warmup=10, sync=sync, launches_only=True)
            in_cpp = fast_path.loaded() and fast_path.counters()["served"] > served
            row = {"op": op, "shape": label, "mode": mode, "ours us": times["ours"], "C++ entry": in_cpp,
                   "flashinfer us": times.get("flashinfer"), "flashinfer": None if callable(peer) else peer}
            rows.append(row)
            print(f"{op} {mode}: ours {times['ours']:.2f} us, flashinfer {times.get('flashinfer', peer)}",
                  file=sys.stderr, flush=True)
    return rows


def goals(rows: list) -> list:
    """Per row: at most :data:`GOAL_US`, and no more than FlashInfer's where it was timed."""
    judged = []
    for r in rows:
        judged.append({"op": r["op"], "mode": r["mode"], "goal": f"host us <= {GOAL_US:g}",
                       "value": r["ours us"], "met": r["ours us"] <= GOAL_US})
        if r["flashinfer us"] is not None:
            judged.append({"op": r["op"], "mode": r["mode"], "goal": "host us <= FlashInfer's",
                           "value": r["ours us"] / r["flashinfer us"], "met": r["ours us"] <= r["flashinfer us"]})
    return judged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--ops", default=None, help="comma-separated op names (default: every op)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--calls", type=int, default=100,
                   help=f"calls a round, fewer where they would launch more than {QUEUED_LAUNCHES} kernels")
    p.add_argument("--out", default=None, help="JSON file for the rows and the goals")
    p.add_argument("--no-peers", action="store_true",
                   help="time ours only (FlashInfer builds each module on first use: 30 s to minutes)")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    rows = measure(a.device, a.ops.split(",") if a.ops else None, a.rounds, a.calls, peers=not a.no_peers)
    judged = goals(rows) if cuda else []
    if a.out:
        header = harness.header() if cuda else {"gpu": None, "versions": harness.versions()}
        harness.write_json(a.out, {**header, "device": a.device, "cpp_entry": fast_path.status(), "rows": rows,
                                   "goals": judged})
    print(f"C++ entry: {fast_path.status()}")
    print(harness.markdown(rows, ["op", "shape", "mode", "ours us", "C++ entry", "flashinfer us", "flashinfer"]))
    if judged:
        missed = [g for g in judged if not g["met"]]
        print(f"\n{len(judged) - len(missed)} of {len(judged)} goals met")
        print(harness.markdown(missed, ["op", "mode", "goal", "value"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
