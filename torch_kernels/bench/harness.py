"""Timing on a CUDA GPU, and the results' headers and tables.

Device time: CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), so that launch cost
does not hide kernel time; :func:`replay_us` is the cheaper variant the suite uses, with an optional
cold L2. Host time per eager call: the best of 5 loops of 5000 calls followed by one synchronise.
Bandwidth: bytes read + written over device time; the ceiling is a device-to-device copy measured in
the same run. Triton is imported only by :func:`graph_us`, so the CPU run of the suite needs none.
"""

import datetime
import importlib
import json
import platform as pyplatform
import statistics
import time
from importlib import metadata

import torch


def graph_us(fn, warmup: int = 3) -> float:
    """Median µs of one call of ``fn``, replayed from a CUDA graph."""
    import triton.testing

    for _ in range(warmup):  # compile/autotune outside the capture
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


#: Untimed replays before the timed ones, for at least this long: with one, the first implementation
#: timed at a large shape ran ~10% slow (per_token_group_quant_fp8 16384x7168: 95 against 85 µs).
WARM_S = 0.02


def _replay_us(graph, replays: int) -> float:
    """Median µs of one replay of ``graph`` (after untimed replays for :data:`WARM_S`), by CUDA events."""
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    while time.perf_counter() - start < WARM_S:
        graph.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _capture(body, calls: int):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            body()
    return graph


def replay_us(fn, flush=None, target_us: float = 1000.0, max_calls: int = 100, replays: int = 5) -> float:
    """Device µs per call of ``fn`` (already warmed up: compiled, autotuned), as
    :func:`replay_us_interleaved` times each function. Raises what the capture raises (a host sync
    inside ``fn``)."""
    times, failed = replay_us_interleaved({"fn": fn}, flush, 1, target_us, max_calls, replays)
    if failed:
        raise failed["fn"]
    return times["fn"]


def replay_us_interleaved(fns: dict, flush=None, rounds: int = 3, target_us: float = 1000.0,
                          max_calls: int = 100, replays: int = 5) -> dict:
    """Device µs per call of each of ``fns`` (``{name: fn}``, already warm): one CUDA graph each holds
    ``n`` back-to-back calls, ``n`` such that a replay lasts about ``target_us`` (from a one-call graph's
    time, at most ``max_calls``), and the median of ``replays`` timed replays is divided by ``n``.

    Every graph is captured first, then they are timed in ``rounds`` interleaved rounds, the order
    rotated each round (A B C, B C A, C A B), each keeping its median round: timed one after another, the
    same FlashInfer kernel read 32.8 and 36.5 µs as two rows (fused_add_rmsnorm 4096x4096 bf16), more
    than the 5% a row is judged by.

    ``flush``: a callable that evicts the L2 cache (a read of a buffer several times its size); each
    graph then holds ``n`` x (flush, fn), and a graph of ``n`` flushes alone, timed the same way, is
    subtracted: ``fn`` starts every call with its inputs in HBM. Returns ``{name: µs}`` and
    ``{name: exception}`` for those whose capture raised (a host sync inside)."""
    graphs, failed = {}, {}
    for name, fn in fns.items():
        body = fn if flush is None else (lambda fn=fn: (flush(), fn()))
        try:
            torch.cuda.synchronize()
            estimate = _replay_us(_capture(body, 1), 3)
            calls = max(1, min(max_calls, int(target_us / max(estimate, 1e-3))))
            graphs[name] = (_capture(body, calls), calls)
        except Exception as e:  # noqa: BLE001  (the caller times it another way)
            torch.cuda.synchronize()
            failed[name] = e
    flushes = {}
    times = {name: [] for name in graphs}
    names = list(graphs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            graph, calls = graphs[name]
            us = _replay_us(graph, replays) / calls
            if flush is not None:
                if calls not in flushes:
                    flushes[calls] = _capture(flush, calls)
                us -= _replay_us(flushes[calls], replays) / calls
            times[name].append(us)
    return {name: statistics.median(t) for name, t in times.items()}, failed


def bandwidth_rows(op: str, shape: str, calls: dict, nbytes: int, ceiling: float, rounds: int, flush=None) -> list:
    """One row per implementation in ``calls`` (``{label: fn}``, checked already) of ``op`` at ``shape``,
    timed in ``rounds`` interleaved rounds (:func:`replay_us_interleaved`, L2 flushed by ``flush`` if
    given): µs, GB/s of ``nbytes`` and the fraction of ``ceiling``, printed as it comes; a capture that
    raised, as a ``status`` row."""
    times, failed = replay_us_interleaved(calls, flush, rounds=rounds)
    rows = []
    for label, us in times.items():
        rows.append({"op": op, "shape": shape, "impl": label, "us": us, "GB/s": nbytes / us / 1e3,
                     "of copy": nbytes / us / 1e3 / ceiling})
        print(rows[-1], flush=True)
    return rows + [{"op": op, "shape": shape, "impl": label, "status": f"failed: {e}"[:160]} for label, e in failed.items()]


def events_us(fn, calls: int = 20, replays: int = 5) -> float:
    """Median µs per call of ``calls`` back-to-back eager calls of ``fn`` between two CUDA events:
    device time where the device is the bottleneck, host time otherwise (for what cannot be captured)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def wall_us(fn, min_s: float = 2e-3, repeat: int = 5) -> float:
    """Median wall-clock µs per call of ``fn`` over ``repeat`` blocks of at least ``min_s`` each (CPU
    tensors: the host clock is the device clock)."""
    fn()
    t0, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - t0 < min_s:
        fn()
        calls += 1
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


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


def host_us_interleaved(cases: dict, rounds: int = 9, calls=3000, warmup: int = 100, sync=None,
                        launches_only: bool = False) -> dict:
    """Host µs per eager call of each case, measured in interleaved rounds (A B C A B C ...) and
    keeping each case's best round, so that drift in the host's clock or load hits every case alike.
    ``calls``: per round, one number or ``{name: number}``; ``sync``: what waits for the device
    (``torch.cuda.synchronize``; a no-op for CPU tensors). ``launches_only``: the clock stops before
    the round's closing wait, so a case whose device time exceeds its host time is not read at its
    device time (then ``calls`` times the launches a call makes must stay under CUDA's queue of about
    a thousand pending launches, which blocks the host)."""
    sync = sync or torch.cuda.synchronize
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    best = {name: float("inf") for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            n = calls[name] if isinstance(calls, dict) else calls
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            if not launches_only:
                sync()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
            sync()
    return best


#: Bytes an L2 flush reads at least (4x the L2 where that is more).
FLUSH_BYTES = 256 << 20


def l2_flush():
    """A callable that evicts the L2 cache of the current CUDA device: a sum over a buffer of
    :data:`FLUSH_BYTES` or four L2s."""
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 0
    buf = torch.ones(max(FLUSH_BYTES, 4 * l2) // 4, device="cuda")
    return lambda: buf.sum()


def optional_module(name: str):
    """The module ``name``, or None where it is not installed (a peer a probe times when it can)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


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


def write_bandwidth_rows(out, ceiling: float, rows: list, columns: list, **extra) -> None:
    """A sweep's ending: its rows (and ``extra``) as JSON at ``out`` if given, then the copy ceiling and
    the rows' ``columns`` as a table on stdout."""
    if out:
        write_json(out, {**header(), "copy GB/s": ceiling, **extra, "rows": rows})
    print(f"\ncopy ceiling {ceiling:.0f} GB/s\n")
    print(markdown(rows, columns))


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


def host_rows(cases: dict, device_case: str, device_label: str) -> list:
    """Host µs per eager call of every case (interleaved rounds), with gradients enabled and under
    ``inference_mode``, then the device µs of ``cases[device_case]`` by graph replay, as table rows."""
    rows = []
    for mode in ("grad enabled", "inference_mode"):
        with torch.inference_mode(mode == "inference_mode"):
            rows += [{"case": name, "host us": us, "mode": mode} for name, us in host_us_interleaved(cases).items()]
    rows.append({"case": device_label, "host us": graph_us(cases[device_case]), "mode": "device us"})
    return rows
