"""Timing on the GPU host, the way shared/gpu/README.md prescribes.

Device time: CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), so that launch cost
does not hide kernel time. Host time per eager call: the best of 5 loops of 5000 calls followed by
one synchronise. Bandwidth: bytes read + written over device time; the ceiling is a device-to-device
copy measured in the same run.
"""

import datetime
import json
import platform as pyplatform
import time
from importlib import metadata

import torch
import triton.testing


def graph_us(fn, warmup: int = 3) -> float:
    """Median µs of one call of ``fn``, replayed from a CUDA graph."""
    for _ in range(warmup):  # compile/autotune outside the capture
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def host_us(fn, loops: int = 5, calls: int = 5000) -> float:
    """Best-of-``loops`` host µs per eager call of ``fn``."""
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def host_us_interleaved(cases: dict, rounds: int = 9, calls: int = 3000) -> dict:
    """Host µs per eager call of each case, measured in interleaved rounds (A B C A B C ...) and
    keeping each case's best round, so that drift in the host's clock or load hits every case alike."""
    for fn in cases.values():
        for _ in range(100):
            fn()
    best = {name: float("inf") for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


def copy_ceiling_gbps(sizes_mb=(64, 256, 1024)) -> float:
    """Device-to-device copy bandwidth, bytes read + written, the best over a few sizes (bf16
    buffers of the benchmark's order of size): the ceiling for memory-bound kernels."""
    best = 0.0
    for mb in sizes_mb:
        src = torch.randn(mb << 19, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        best = max(best, 2 * (mb << 20) / graph_us(lambda: dst.copy_(src)) / 1e3)
    return best


def versions() -> dict:
    out = {"torch": torch.__version__, "python": pyplatform.python_version()}
    for pkg in ("triton", "tilelang", "flashinfer-python"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            try:
                out[pkg] = __import__(pkg.split("-")[0]).__version__
            except Exception:
                out[pkg] = None
    return out


def header() -> dict:
    return {"gpu": torch.cuda.get_device_name(), "compute_capability": list(torch.cuda.get_device_capability()),
            "versions": versions(), "date": datetime.date.today().isoformat()}


def write_json(path, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def markdown(rows: list, columns: list) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)
