"""``python -m torch_kernels bench``: every op x every usable backend x the peers over the shape set,
in one run, written as JSON, a markdown table and one PNG plot per op. What an op is run on (shapes,
arguments, bytes, peers, goals) comes from its definition's bench case (``OpDef.bench``); an op
without one is listed as not benchmarked.

Implementations timed for each (op, shape), by key (``--backends`` narrows to some):

* ``op``: the registered op ``torch.ops.deepinfer.<op>`` (what the CUDA key selects: the ``serves``
  column); ``auto``: what the op's CUDA entry calls under ``DEEPINFER_OPS_BACKEND=auto``, whatever the
  selection of this run (``dispatch.auto_function``: the tuned table's winner for the shape's bucket, the
  platform default where it has none or its entry is stale; off CUDA the reference); ``triton``, ``tilelang``, ``flashinfer``: each backend of the inventory usable here
  (``registry.implementations(op)``, ``KernelSpec.is_available``), called directly; a call it refuses
  (``KernelSpec.dtypes`` or its ``check``) is reported ``refused: <why>``, not timed;
* the peers: ``torch``, the reference in eager mode; ``compile``, ``torch.compile`` of the reference,
  compiled with the token dimension dynamic (:func:`_tokens_dynamic`: one graph per hidden size serves
  every token count; Dynamo adds one for a single token), skipped where the inventory records that
  Inductor fails on it; the peers the bench case names (``BenchCase.peers``, as ``F.rms_norm`` for
  ``rmsnorm``); ``flashinfer-api``, FlashInfer's own function (``BenchCase.flashinfer``).

Each implementation is first checked against the reference at the shape (the op's own comparison, or
its bench case's: ``BenchCase.compare``, as near-tied router rows left out, or sampled ids from another
random stream in the reference's kept set). Then, on CUDA:

* device µs by CUDA-graph replay: a graph of n back-to-back calls (n up to 100, a replay of about 1 ms),
  the median of 5 replays over n; every implementation of a shape captured first, then timed in 3
  interleaved rounds in rotated order, the median round kept (``harness.replay_us_interleaved``); ``--cold-l2``: each call preceded in the
  graph by a read of a buffer of max(256 MB, 4 x L2) (a read, so that no dirty line of the flush is
  written back during the op), and the graph of the flushes alone subtracted. A function that cannot
  be captured (a host sync) is timed by CUDA events around 20 eager calls instead (``timing`` says so);
* host µs per eager call at 1 and 32 tokens (``--host-tokens``): the best of 3 interleaved rounds of
  about 5 ms each (1 to 200 calls, then one synchronise);
* GB/s from the bench case's ``nbytes`` (each tensor read or written once), and its ratio to a device-to-device
  copy measured at the start of the same run; ``vs best peer``: the fastest peer's device time over
  this one's (above 1: faster than every peer).

Everything runs under ``torch.inference_mode()``, as a serving engine does. Without a GPU the same
command runs a small CPU set (the ops whose bench case sets ``cpu_default``, tiny shapes, one thread,
wall-clock time; torch.compile and interpreted Triton only when named in ``--backends``), so that CI
exercises it; it judges no goal (they are set for a CUDA GPU).

    python -m torch_kernels bench [--ops rmsnorm,silu_and_mul] [--backends op,triton,compile]
        [--shapes full|quick|1,32,4096x8192] [--cold-l2] [--out DIR] [--no-plots] [--budget S]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform as pyplatform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import dispatch, ops, registry, tuning
from ..spec import Backend, Platform
from ..testing import compare_outputs, mutated_args, outputs_of
from . import cases, default_out, harness, report

SCHEMA = 1
CPU_OPS = tuple(d.name for d in ops.ALL if d.bench is not None and d.bench.cpu_default)
#: the peers a bench case names beside the reference, compile and FlashInfer's API: key and label alike
OTHER_PEERS = tuple(dict.fromkeys(p.name for d in ops.ALL if d.bench is not None for p in d.bench.peers))
PEER_KEYS = ("torch", "compile", *OTHER_PEERS, "flashinfer-api")
KEYS = ("op", "auto", *(b.value for b in Backend if b is not Backend.TORCH), *PEER_KEYS)
LABELS = {"op": report.OP_LABEL, "auto": report.AUTO_LABEL, "torch": "torch eager", "compile": "torch.compile", **{k: k for k in OTHER_PEERS},
          "flashinfer-api": "FlashInfer API", "flashinfer": "flashinfer backend"}
ROUNDS = 3  # device timing: every implementation of a shape in 3 interleaved rounds, the median kept
HOST_ROUNDS, HOST_ROUND_US = 3, 5000.0  # host timing: best of 3 rounds of ~5 ms (1 to 200 calls)


@dataclass
class Impl:
    """One implementation at one shape: timed when ``status`` is None, else reported with it."""

    key: str
    label: str
    role: str  # "ours" or "peer"
    fn: Optional[Callable] = None  # fn(*args)
    status: Optional[str] = None
    prepare: Callable[[tuple], tuple] = lambda args: args
    adapt: Callable[[list], list] = lambda outs: outs
    compare: Optional[Callable] = None


@dataclass
class Context:
    cuda: bool
    device: str
    dtype: torch.dtype
    profile: cases.Profile
    keys: Tuple[str, ...]
    explicit_keys: bool
    host_tokens: Tuple[int, ...]
    flush: Optional[Callable] = None
    ceiling: float = 0.0
    deadline: float = float("inf")
    sync: Callable = lambda: None
    failures: List[str] = field(default_factory=list)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


class OpRunner:
    """The implementations of one op, loaded once; ``impls(args)`` says which take a call."""

    def __init__(self, op: str, ctx: Context, platform: Platform) -> None:
        self.op, self.ctx = op, ctx
        self.opdef = ops.BY_NAME[op]
        self.case = cases.case(op)
        self.overload = getattr(torch.ops.deepinfer, op).default
        self.mutated = mutated_args(self.overload)
        self.reference = registry.BY_OP[op][Backend.TORCH].load()
        self.unavailable: Dict[str, str] = {}
        self.backends = []  # (dispatch.Implementation, label, status)
        interpret = not ctx.cuda and os.environ.get("TRITON_INTERPRET") == "1"
        for spec in registry.implementations(op):
            key = spec.backend.value
            if spec.backend is Backend.TORCH or key not in ctx.keys:
                continue
            why = spec.unavailable_reason(platform)
            interpreted = why is not None and interpret and spec.backend is Backend.TRITON and ctx.explicit_keys
            if why is not None and not interpreted:
                self.unavailable[key] = why
                continue
            label = LABELS.get(key, key) + (" (interpreted)" if interpreted else "")
            impl = dispatch.Implementation(spec, self.opdef.data_arg)
            try:
                impl.load()
                self.backends.append((impl, label, None))
            except Exception as e:  # noqa: BLE001  (reported on every shape)
                self.backends.append((impl, label, f"failed to load: {_first_line(e)}"))
        chain = dispatch.plan(op, platform)[0] if ctx.cuda else []
        self.chain = [dispatch.Implementation(spec, self.opdef.data_arg) for spec in chain]
        self.default_chain = [dispatch.Implementation(spec, self.opdef.data_arg) for spec in registry.implementations(op)
                              if spec.is_available(platform)] if ctx.cuda else []
        self.auto = dispatch.auto_function(op, self.opdef.data_arg, platform) if "auto" in ctx.keys else None
        self.compile_status = None
        no_compile = registry.REFERENCE_NOT_COMPILABLE.get(op)
        if no_compile:
            self.compile_status = f"skipped: {no_compile}"
        elif not ctx.cuda and not ctx.explicit_keys:
            self.compile_status = "off"  # the CPU set compiles only on request (Inductor's C++ build is slow)
        # compiles nothing until called (warm_compile)
        self.compiled = (torch.compile(self.reference, dynamic=False)
                         if self.compile_status is None and "compile" in ctx.keys else None)

    def serves(self, args: tuple, auto: bool = False) -> str:
        """The backend the op's CUDA entry picks for ``args`` (first in its chain that takes them), under this
        run's selection or (``auto``) under ``DEEPINFER_OPS_BACKEND=auto``."""
        if not self.ctx.cuda:
            return "torch"
        chain = self.default_chain if auto else self.chain
        table = dispatch.tuned_table() if auto or dispatch.selection().auto else None
        chosen = tuning.winner(table, self.op, args[self.opdef.data_arg]) if table else None
        if chosen:  # auto: the bucket's winner first, then the platform default's order
            chain = sorted(chain, key=lambda impl: impl.spec.backend.value != chosen[0])
        for impl in chain:
            if impl.refuses(args) is None:
                return impl.spec.backend.value
        return "none"

    def warm_compile(self, shapes) -> None:
        """Call the compile peer first at each hidden size's largest token count in ``shapes`` (``(rows,
        hidden, label)``): Inductor then sizes and autotunes the token-dynamic graph's kernels for a full
        batch, as vLLM compiles with its largest batch as the hint. First compiled at 32 tokens (the
        shapes ascend), its configs for 32 tokens served the large shapes, picked differently from run
        to run where they tie: silu_and_mul 16384x2*8192 bf16 ran 3202 GB/s in one suite and 4346 in the
        next, merge_attn_states 16384x32x128 230 (4276 and 4191 compiled at 16384 tokens;
        docs/benchmarks/README.md)."""
        if "compile" not in self.ctx.keys or self.compile_status is not None:
            return
        largest: Dict[Optional[int], int] = {}
        for rows, hidden, _ in shapes:
            largest[hidden] = max(rows, largest.get(hidden, 0))
        for hidden, rows in largest.items():
            if rows > 1:  # one token is a graph of its own (Dynamo specialises sizes 0 and 1)
                args = cases.build(self.op, rows, hidden, self.ctx.profile, self.ctx.device, self.ctx.dtype)
                try:
                    self.compiled(*_tokens_dynamic(args, self.opdef.data_arg))
                except Exception:  # noqa: BLE001  (run_case reports it at that shape)
                    pass
                del args

    def impls(self, args: tuple) -> List[Impl]:
        keys, out = self.ctx.keys, []
        if "op" in keys:
            out.append(Impl("op", LABELS["op"], "ours", self.overload))
        if self.auto is not None:
            out.append(Impl("auto", LABELS["auto"], "ours", self.auto))
        for impl, label, status in self.backends:
            if status is None:
                why = impl.refuses(args)
                status = None if why is None else f"refused: {why}"
            out.append(Impl(impl.spec.backend.value, label, "ours", impl.fn, status))
        if "torch" in keys:
            out.append(Impl("torch", LABELS["torch"], "peer", self.reference))
        if "compile" in keys and self.compile_status != "off":
            data_arg = self.opdef.data_arg
            out.append(Impl("compile", LABELS["compile"], "peer", self.compiled, self.compile_status,
                            lambda args: _tokens_dynamic(args, data_arg)))
        for peer in self.case.peers:
            if peer.name in keys:
                out.append(Impl(peer.name, LABELS[peer.name], "peer", peer.fn, None, peer.prepare, peer.adapt, peer.compare))
        if "flashinfer-api" in keys and self.ctx.cuda:
            peer = cases.flashinfer_api(self.op, args)
            if isinstance(peer, str):
                out.append(Impl("flashinfer-api", LABELS["flashinfer-api"], "peer", status=peer))
            else:
                out.append(Impl("flashinfer-api", LABELS["flashinfer-api"], "peer", peer.fn, None,
                                peer.prepare, peer.adapt, peer.compare))
        return out

    def verify(self, impl: Impl, got: list, want: list, args: tuple) -> str:
        """"ok", or what differs from the reference (MISMATCH for ours, "differs" for a peer)."""
        dtype, note = args[self.opdef.data_arg].dtype, None
        try:
            if impl.compare is not None:
                impl.compare(got, want, dtype)
            elif self.case.compare is not None:
                note = self.case.compare(got, want, dtype, args)
            else:
                compare_outputs(self.opdef, got, want, dtype)
            return f"ok ({note})" if note else "ok"
        except AssertionError as e:
            return ("MISMATCH: " if impl.role == "ours" else "differs: ") + _first_line(e)


def device_times(fns: Dict[str, Callable], ctx: Context) -> Dict[str, object]:
    """``{name: (µs, how timed)}``, or the exception its timing raised: on CUDA every graph first, then
    interleaved rounds (``harness.replay_us_interleaved``); a function that cannot be captured (a host
    sync inside) by CUDA events around eager calls instead."""
    if not ctx.cuda:
        return {name: (harness.wall_us(fn), "wall clock") for name, fn in fns.items()}
    timed, failed = harness.replay_us_interleaved(fns, ctx.flush, rounds=ROUNDS)
    out: Dict[str, object] = {name: (us, "graph" + (", cold L2" if ctx.flush else "")) for name, us in timed.items()}
    for name, e in failed.items():
        try:
            out[name] = (harness.events_us(fns[name]), f"eager events ({type(e).__name__} in capture)")
        except Exception as again:  # noqa: BLE001
            out[name] = again
    return out


def _tokens_dynamic(args: tuple, data_arg: int) -> tuple:
    """``args`` with the token dimension marked dynamic for the ``compile`` peer, as vLLM compiles a
    model: one graph per hidden size serves every batch size, the other sizes constants Inductor can
    tile for. With ``dynamic=True`` (every size symbolic) Inductor's kernels ran far slower: silu_and_mul
    16384x2*4096 bf16 1659 GB/s against 4323 token-dynamic on the H200, rmsnorm 16384x8192 2277 against
    4143 (docs/design/compile.md).

    The token dimension: dim 0 of every tensor as long as the data argument's, except a weight (a 1-D
    float tensor as long as the data's last dim, as 4096 tokens of 4096): marking it would recompile."""
    data = args[data_arg]
    for t in args:
        if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[0] != data.shape[0]:
            continue
        if t is not data and t.dim() == 1 and t.is_floating_point() and t.shape[0] == data.shape[-1]:
            continue
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return args


def run_case(runner: OpRunner, rows: int, hidden: Optional[int], label: str, args: tuple, ctx: Context) -> List[dict]:
    """Check, then time, every implementation of ``runner.op`` on ``args``; one result row each."""
    op, mutated = runner.op, runner.mutated
    base = {"op": op, "shape": label, "tokens": rows, "hidden": hidden,
            "dtype": str(args[runner.opdef.data_arg].dtype).replace("torch.", ""), "bytes": runner.case.nbytes(args),
            "bucket": list(tuning.bucket_features(args[runner.opdef.data_arg]))}
    want = outputs_of(runner.reference, args, mutated)  # before any timed call mutates args
    results, live = [], []
    for impl in runner.impls(args):
        row = {**base, "impl": impl.label, "key": impl.key, "role": impl.role}
        if impl.key in ("op", "auto"):
            row["serves"] = runner.serves(args, auto=impl.key == "auto")
        if impl.status is not None:
            results.append({**row, "status": impl.status})
            continue
        try:
            call_args = impl.prepare(args)
            row["check"] = runner.verify(impl, impl.adapt(outputs_of(impl.fn, call_args, mutated)), want, args)
        except Exception as e:  # noqa: BLE001  (a failing implementation is reported, the run goes on)
            results.append({**row, "status": f"failed: {_first_line(e)}"})
            if impl.key == "compile":
                runner.compile_status = f"skipped: torch.compile failed at {label}: {_first_line(e)}"
            continue
        results.append(row)
        live.append((impl, row, call_args))
    fns = {row["impl"]: (lambda f, a: lambda: f(*a))(impl.fn, call_args) for impl, row, call_args in live}
    times = device_times(fns, ctx)
    for _, row, _ in live:
        if isinstance(times[row["impl"]], Exception):
            row["status"] = f"failed in timing: {_first_line(times[row['impl']])}"
        else:
            row["device_us"], row["timing"] = times[row["impl"]]
    timed = [(impl, row, call_args) for impl, row, call_args in live if "device_us" in row]
    if rows in ctx.host_tokens and timed:
        calls = {row["impl"]: int(min(200, max(1, HOST_ROUND_US / max(row["device_us"], 1.0)))) for _, row, _ in timed}
        try:  # warm already: checked and timed
            host = harness.host_us_interleaved({name: fns[name] for name in calls}, rounds=HOST_ROUNDS, calls=calls,
                                               warmup=1, sync=ctx.sync)
            for _, row, _ in timed:
                row["host_us"] = host[row["impl"]]
        except Exception as e:  # noqa: BLE001
            for _, row, _ in timed:
                row["host_note"] = f"failed: {_first_line(e)}"
    peers = [r["device_us"] for _, r, _ in timed if r["role"] == "peer"]
    for _, row, _ in timed:
        row["GB/s"] = row["bytes"] / row["device_us"] / 1e3
        row["of copy"] = row["GB/s"] / ctx.ceiling if ctx.ceiling else None
        row["vs best peer"] = min(peers) / row["device_us"] if peers else None
    for row in results:
        if row["role"] == "ours" and (str(row.get("check", "")).startswith("MISMATCH") or
                                      str(row.get("status", "")).startswith("failed")):
            ctx.failures.append(f"{op} {label} {row['impl']}: {row.get('check') or row['status']}")
    return results


# ------------------------------------------------------------------------------------------------
# Shapes and options


def parse_shapes(spec: str, profile: cases.Profile) -> Tuple[Tuple[int, ...], Tuple[int, ...], Dict[int, Tuple[int, ...]]]:
    """``full``, ``quick`` or ``1,32,4096x8192``: (token counts, the hidden sizes of a bare token count,
    {tokens: hidden sizes given with it})."""
    if spec in ("full", "quick"):
        tokens = profile.tokens if spec == "full" else profile.quick_tokens
        return tokens, (profile.hidden if spec == "full" else profile.hidden[:1]), {}
    explicit: Dict[int, list] = {}
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:x(\d+))?\s*", item)
        if not m:
            raise SystemExit(f"--shapes: {item!r} is not TOKENS or TOKENSxHIDDEN (e.g. 1,32,4096x8192), "
                             "nor 'full' or 'quick'")
        explicit.setdefault(int(m.group(1)), []).extend([int(m.group(2))] if m.group(2) else [])
    return tuple(sorted(explicit)), profile.hidden, {t: tuple(dict.fromkeys(h)) for t, h in explicit.items() if h}


def op_shapes(op: str, tokens: Tuple[int, ...], hidden: Tuple[int, ...], explicit: Dict[int, Tuple[int, ...]],
              profile: cases.Profile):
    """(rows, hidden, label) of each shape of ``op``, deduplicated (a bench case may cap the rows). An op
    that takes the profile's hidden sizes takes the given ones (else ``hidden``); one with its own
    chooses among the given ones (``BenchCase.own_hidden``); the other ops have a fixed inner shape."""
    seen, out = set(), []
    for t in tokens:
        for h in cases.hidden_sizes(op, explicit.get(t, ()), hidden, profile):
            shape = cases.shape_of(op, t, h, profile)
            if shape[2] not in seen:
                seen.add(shape[2])
                out.append(shape)
    # one hidden size after another, tokens ascending: the plots' lines
    return sorted(out, key=lambda s: (s[1] or 0, s[0]))


def _split(text: Optional[str], known, what: str) -> Optional[Tuple[str, ...]]:
    if text is None:
        return None
    items = tuple(i.strip() for i in text.split(",") if i.strip())
    bad = [i for i in items if i not in known]
    if bad:
        raise SystemExit(f"--{what}: unknown {', '.join(map(repr, bad))}; known: {', '.join(known)}")
    return items


# ------------------------------------------------------------------------------------------------
# Header and the host goal's measurement


def header(ctx: Context, command: str) -> dict:
    out = {"schema": SCHEMA, "command": command, "date": datetime.date.today().isoformat(),
           "versions": harness.versions(), "profile": ctx.profile.name, "dtype": str(ctx.dtype).replace("torch.", ""),
           "mode": "torch.inference_mode()"}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(), gpu=torch.cuda.get_device_name(),
                   compute_capability=list(torch.cuda.get_device_capability()),
                   l2_bytes=getattr(props, "L2_cache_size", None))
    else:
        n = torch.get_num_threads()
        out.update(device=f"cpu ({pyplatform.machine()}, {n} thread{'s' * (n > 1)})", gpu=None,
                   compute_capability=None)
    out.update(copy_ceiling_GBps=ctx.ceiling, cold_l2=ctx.flush is not None,
               timing=("CUDA-graph replay: n back-to-back calls a graph (n <= 100, ~1 ms a replay), median of 5 "
                       f"replays / n, every implementation of a shape in {ROUNDS} interleaved rounds (rotated), the median "
                       "round" + ("; each call after a read of a buffer larger than L2, the flushes alone "
                                        "subtracted" if ctx.flush else "; L2 warm") if ctx.cuda else
                       "wall clock: median of 5 blocks of >= 2 ms"),
               host_timing=f"best of {HOST_ROUNDS} interleaved rounds of ~{HOST_ROUND_US / 1e3:.0f} ms, at tokens "
                           f"{', '.join(map(str, ctx.host_tokens))}",
               compile="torch.compile(reference), token dimension dynamic (maybe_mark_dynamic): a graph per hidden size, "
                       "first called at its largest token count")
    return out


def host_goal(op: str, rounds: int = 5) -> dict:
    """The measurement of ``op``'s host goal (CUDA): µs per eager call of the op at the goal's shape
    with its backend selected, and of its peer, interleaved, in inference mode (how an engine calls);
    restores the selection."""
    from .. import fast_path

    goal = cases.case(op).host_goal
    peer = next(p for p in cases.case(op).peers if p.name == goal.peer)
    previous = dispatch.configure(backend=goal.backend)
    try:
        with torch.inference_mode():
            rows, hidden, _ = cases.shape_of(op, goal.tokens, goal.hidden, cases.PROFILES["gpu"])
            args = cases.build(op, rows, hidden, cases.PROFILES["gpu"], "cuda", getattr(torch, goal.dtype))
            peer_args = peer.prepare(args)
            fn = getattr(torch.ops.deepinfer, op).default
            for _ in range(2):
                fn(*args)  # the first call publishes the signature to the C++ entry
            served = fast_path.counters()["served"]
            times = harness.host_us_interleaved({"op": lambda: fn(*args), goal.peer: lambda: peer.fn(*peer_args)},
                                                rounds=rounds, calls=5000)
            return {**times, "backend": goal.backend, "mode": "inference_mode",
                    "cpp_entry": fast_path.status().split(" (")[0], "served_in_cpp": fast_path.counters()["served"] > served}
    finally:
        dispatch.configure(previous)


class Progress:
    """tqdm on stderr when it is installed, else a line every 10 s (and at the end)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.last = total, 0, time.monotonic()
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="case", mininterval=1 if sys.stderr.isatty() else 10)
        except ImportError:
            self.bar = None

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        elif self.done == self.total or time.monotonic() - self.last > 10:
            self.last = time.monotonic()
            print(f"[bench] {self.done}/{self.total} {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _cpu_copy_gbps() -> float:
    src = torch.randn(8 << 20)  # 32 MB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / harness.wall_us(lambda: dst.copy_(src)) / 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kernels bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", help=f"comma list (default: every op on CUDA; {', '.join(CPU_OPS)} on CPU)")
    parser.add_argument("--backends", help=f"comma list of implementation keys: {', '.join(KEYS)} (default: all)")
    parser.add_argument("--shapes", default="full", help="full (default), quick, or a list like 1,32,4096x8192 "
                                                         "(TOKENS: every hidden size; TOKENSxHIDDEN: that one)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="data dtype of the ops' inputs (an op whose kernels take one dtype only, as fp32 "
                             "probabilities, keeps its own)")
    parser.add_argument("--host-tokens", help="token counts at which host µs per eager call are timed "
                                              "(default: those up to 32)")
    parser.add_argument("--cold-l2", action="store_true", help="flush L2 before every timed call (CUDA)")
    parser.add_argument("--out", type=Path, help="output folder (default: docs/benchmarks/suite of a source checkout, "
                                                 "else torch_kernels_bench/suite here)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    parser.add_argument("--budget", type=float, help="seconds: start no new op after this; the rest is listed as not run")
    parser.add_argument("--cpu", action="store_true", help="run the CPU set even where there is a GPU")
    args = parser.parse_args(argv)
    platform = Platform() if args.cpu else Platform.detect()
    threads = torch.get_num_threads()
    if not platform.is_cuda:
        # One thread: on a shared 2-core CI runner, 2 threads made a 256x1024 bf16 silu take 16.8 ms
        # against 1.2 ms on one (OpenMP workers waiting for a busy core); the CPU set is a smoke test.
        torch.set_num_threads(1)
    try:
        return run(args, platform, argv)
    finally:
        torch.set_num_threads(threads)


def run(args, platform: Platform, argv) -> int:
    start = time.monotonic()
    cuda = platform.is_cuda
    profile = cases.PROFILES["gpu" if cuda else "cpu"]
    op_names = _split(args.ops, registry.OPS, "ops") or (registry.OPS if cuda else CPU_OPS)
    keys = _split(args.backends, KEYS, "backends")
    ctx = Context(cuda=cuda, device="cuda" if cuda else "cpu", dtype=getattr(torch, args.dtype), profile=profile,
                  keys=keys or KEYS, explicit_keys=keys is not None,
                  host_tokens=(tuple(int(t) for t in args.host_tokens.split(",") if t.strip()) if args.host_tokens
                               else tuple(t for t in profile.tokens if t <= 32)),
                  sync=torch.cuda.synchronize if cuda else (lambda: None))
    if args.budget is not None:
        ctx.deadline = start + args.budget
    tokens, hidden, explicit = parse_shapes(args.shapes, profile)
    not_benchmarked = [op for op in op_names if not cases.benchmarked(op)]
    plan = [(op, s) for op in op_names if op not in not_benchmarked
            for s in op_shapes(op, tokens, hidden, explicit, profile)]
    command = " ".join(["python -m torch_kernels bench", *(sys.argv[1:] if argv is None else argv)])
    torch.manual_seed(0)
    # the compile peer: a graph per hidden size and one more for a single token (_tokens_dynamic), up to
    # 3 + 3 an op in the full set, near Dynamo's default limit of 8 recompiles
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    if cuda:
        ctx.ceiling = harness.copy_ceiling_gbps()
        if args.cold_l2:
            ctx.flush = harness.l2_flush()
    else:
        if args.cold_l2:
            print("[bench] --cold-l2 applies to CUDA only; ignored on CPU", file=sys.stderr)
        ctx.ceiling = _cpu_copy_gbps()
    not_run: List[str] = []
    result = {"header": header(ctx, command), "goals": [], "failures": ctx.failures, "not_run": not_run, "rows": []}
    if not_benchmarked:
        result["not_benchmarked"] = not_benchmarked
        for op in not_benchmarked:
            print(f"[bench] {op}: {cases.NOT_BENCHMARKED}", file=sys.stderr)
    result["header"].update(ops=list(op_names), keys=list(ctx.keys), shapes=args.shapes, unavailable={},
                            cuda_key_serves={op: [k.backend.value for k in dispatch.plan(op, platform)[0]]
                                             for op in op_names} if cuda else None)
    out = args.out or default_out("suite")
    progress = Progress(len(plan))
    with torch.inference_mode():
        for op in dict.fromkeys(op for op, _ in plan):
            shapes = [s for o, s in plan if o == op]
            if time.monotonic() > ctx.deadline:
                not_run.append(op)
                for _ in shapes:
                    progress.step(f"{op} not run")
                continue
            runner = OpRunner(op, ctx, platform)
            runner.warm_compile(shapes)
            if runner.unavailable:
                result["header"]["unavailable"][op] = runner.unavailable
            for rows, h, label in shapes:
                case_args = cases.build(op, rows, h, profile, ctx.device, ctx.dtype)
                result["rows"] += run_case(runner, rows, h, label, case_args, ctx)
                del case_args
                progress.step(f"{op} {label}")
            if cuda:
                torch.cuda.empty_cache()
            result["goals"] = report.goals(result["rows"]) if cuda else []
            result["header"]["elapsed_s"] = round(time.monotonic() - start, 1)
            report.write(result, out, plots=False)  # a run cut short keeps what it has measured
    progress.close()
    with_goal = [op for op in dict.fromkeys(op for op, _ in plan) if cases.case(op).host_goal is not None]
    if cuda and with_goal and time.monotonic() < ctx.deadline:
        measured = {op: host_goal(op) for op in with_goal}
        # one op's measurement under "host_goal" (the results' key); keyed by op where several carry one
        result["host_goal"] = next(iter(measured.values())) if len(measured) == 1 else measured
        result["goals"] = report.goals(result["rows"], measured)
    result["header"]["elapsed_s"] = round(time.monotonic() - start, 1)
    paths = report.write(result, out, plots=not args.no_plots)
    met = sum(g["met"] for g in result["goals"])
    judged = f"goals met {met}/{len(result['goals'])}" if cuda else f"goals not judged ({report.GOALS_NOT_JUDGED})"
    print(f"[bench] {len(result['rows'])} rows in {result['header']['elapsed_s']:.0f} s; {judged}; "
          f"{len(ctx.failures)} failure(s) of our implementations; wrote {', '.join(str(p) for p in paths[:2])}"
          + (f" and {len(paths) - 2} plots" if len(paths) > 2 else ""), file=sys.stderr)
    for f in ctx.failures:
        print(f"[bench] FAILED {f}", file=sys.stderr)
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())
