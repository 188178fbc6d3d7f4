"""What Inductor generates for the norm and activation references, and how fast it runs, beside our
Triton and TileLang kernels in the same run (the H200 host):

    python benchmarks/probe_inductor.py --out results/probe

``torch.compile`` of the reference in two modes: every size static, and the token dimension dynamic
(``mark_dynamic(x, 0)``, what an engine compiling for any batch size gets: the hidden size stays a
constant, so Inductor can keep the row in one persistent reduction). Writes each compiled graph's
generated code to ``<out>/<op>_<mode>_<hidden>.py`` and prints GB/s by CUDA-graph replay against a
copy measured in the same run, every implementation of a shape in interleaved rounds.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from torch_kernels.families.activation import tilelang as tl_act  # noqa: E402
from torch_kernels.families.norm import tilelang as tl_norm  # noqa: E402
from torch_kernels.families.activation import reference as ref_act  # noqa: E402
from torch_kernels.families.norm import reference as ref_norm  # noqa: E402
from torch_kernels.families.activation import triton as tr_act  # noqa: E402
from torch_kernels.families.norm import triton as tr_norm  # noqa: E402

SHAPES = ((16384, 8192), (16384, 7168))
ROUNDS = 5  # interleaved timing rounds, the median kept (harness.replay_us_interleaved)
OPS = {  # op -> (reference, Triton, TileLang, bytes moved per element of the (tokens, hidden) output)
    "rmsnorm": (ref_norm.rmsnorm, tr_norm.rmsnorm, tl_norm.rmsnorm, 4),
    "gemma_rmsnorm": (ref_norm.gemma_rmsnorm, tr_norm.gemma_rmsnorm, tl_norm.gemma_rmsnorm, 4),
    "fused_add_rmsnorm": (ref_norm.fused_add_rmsnorm, tr_norm.fused_add_rmsnorm, tl_norm.fused_add_rmsnorm, 8),
    "silu_and_mul": (ref_act.silu_and_mul, tr_act.silu_and_mul, tl_act.silu_and_mul, 6),
}


_SEEN: set = set()


def _chosen_configs():
    """(kernel name, launch config) of every Inductor Triton kernel loaded so far, after autotuning."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    for module in list(PyCodeCache.modules):
        if id(module) in _SEEN:
            continue
        _SEEN.add(id(module))
        for name, value in vars(module).items():
            if isinstance(value, CachingAutotuner):
                yield name, [str(launcher.config) for launcher in value.launchers]


def main() -> None:
    from torch._inductor.utils import run_and_get_code

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ceiling = harness.copy_ceiling_gbps()
    rows = []
    for op, (ref, triton_fn, tilelang_fn, bpe) in ((k, OPS[k]) for k in args.ops.split(",")):
        act = op.endswith("_and_mul")
        for tokens, n in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(tokens + n)
            x = torch.randn(tokens, 2 * n if act else n, device="cuda", dtype=torch.bfloat16, generator=g)
            r = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
            nbytes = tokens * n * bpe
            call_args = (x,) if act else (x, r, w) if op.startswith("fused") else (x, w)
            impls = {"triton": triton_fn, "tilelang": tilelang_fn}
            for mode in ("static", "tokens dynamic"):
                torch._dynamo.reset()
                compiled = torch.compile(ref, dynamic=False)
                if mode == "tokens dynamic":
                    for t in call_args[:2 if op.startswith("fused") else 1]:
                        torch._dynamo.mark_dynamic(t, 0)
                try:
                    _, code = run_and_get_code(compiled, *[t.clone() for t in call_args])
                except Exception as e:  # noqa: BLE001  (an Inductor failure is this mode's result)
                    rows.append({"op": op, "shape": f"{tokens}x{n}", "impl": f"compile {mode}",
                                 "status": f"{type(e).__name__}: {e}"[:160]})
                    continue
                with open(os.path.join(args.out, f"{op}_{mode.replace(' ', '_')}_{tokens}x{n}.py"), "w") as f:
                    f.write("\n\n# ----\n\n".join(code))
                impls[f"compile {mode}"] = compiled
                for name, config in _chosen_configs():
                    print(f"{op} {tokens}x{n} {mode}: {name} {config}", flush=True)
            want = [t.clone() for t in call_args]
            want_out = ref(*want)
            calls = {}
            for label, fn in impls.items():
                mine = [t.clone() for t in call_args]
                got = fn(*mine)
                torch.testing.assert_close(got if got is not None else mine[0], want_out if want_out is not None else want[0],
                                           atol=2e-2, rtol=2e-2)
                calls[label] = (lambda fn, mine: lambda: fn(*mine))(fn, mine)
            rows += harness.bandwidth_rows(op, f"{tokens}x{n}", calls, nbytes, ceiling, ROUNDS)
    harness.write_json(os.path.join(args.out, "probe.json"), {**harness.header(), "copy GB/s": ceiling, "rows": rows})
    print(f"\ncopy ceiling {ceiling:.0f} GB/s\n")
    print(harness.markdown(rows, ["op", "shape", "impl", "us", "GB/s", "of copy", "status"]))


if __name__ == "__main__":
    main()
