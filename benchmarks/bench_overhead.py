"""Where the host time of one eager ``torch.ops.deepinfer.rmsnorm`` call goes (1x4096 bf16 on CUDA,
TileLang selected), beside ``F.rms_norm`` in the same interleaved rounds (and silu_and_mul beside
FlashInfer's): allocation, the launchers, the op through the C++ entry (``torch_kernels/fast_path.py``)
and through the Python kernels (its twin ``deepinfer_py::rmsnorm``), its out overload both ways, with gradients enabled, under
``no_grad`` and in inference mode; the in-place fused_add_rmsnorm and a decode step's rotary_embedding
(their validation proves the written arguments apart in memory on every call).

    python -m torch_kernels build && python benchmarks/bench_overhead.py
"""

import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402
from benchmarks import harness  # noqa: E402
from torch_kernels import dispatch, fast_path  # noqa: E402
from torch_kernels.families.norm import tilelang as tilelang_norm  # noqa: E402
from torch_kernels.families.norm import triton as triton_norm  # noqa: E402
from torch_kernels.families.rope import ops as rope # noqa: E402

EPS = 1e-6
HIDDEN = 4096
MODES = (("grad enabled", torch.enable_grad), ("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode))


@contextlib.contextmanager
def _tilelang_selected():
    previous = dispatch.configure(backend="tilelang")
    try:
        yield
    finally:
        dispatch.configure(previous)


def _inputs():
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return x, torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)


def cases(x, w) -> dict:
    op = torch.ops.deepinfer.rmsnorm.default
    out = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "F.rms_norm": lambda: F.rms_norm(x, (HIDDEN,), w, EPS),
        "TileLang launcher (Python, direct)": lambda: tilelang_norm.rmsnorm(x, w, EPS),
        "Triton launcher (direct)": lambda: triton_norm.rmsnorm(x, w, EPS),
        "torch.ops.deepinfer.rmsnorm": lambda: op(x, w, EPS),
        "torch_kernels.rmsnorm (wrapper)": lambda: torch_kernels.rmsnorm(x, w, EPS),
    }
    y = torch.empty_like(x)  # vLLM's rms_norm(out, input, weight, eps): into a preallocated output
    out["torch.ops.deepinfer.rmsnorm.out"] = lambda: torch.ops.deepinfer.rmsnorm.out(x, w, EPS, out=y)
    hidden, residual = torch.randn_like(x), torch.randn_like(x)
    out["torch.ops.deepinfer.fused_add_rmsnorm (1x4096)"] = (
        lambda: torch.ops.deepinfer.fused_add_rmsnorm.default(hidden, residual, w, EPS))
    # a decode step's rope: 32 tokens, 32 query and 8 key heads of 128 as slices of one qkv tensor
    qkv = torch.randn(32, 48 * 128, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :4096], qkv[:, 4096:5120]
    positions, cache = torch.randint(0, 4096, (32,), device="cuda"), rope.make_cos_sin_cache(4096, 128, device="cuda")
    out["torch.ops.deepinfer.rotary_embedding (32 tokens, qkv slices)"] = (
        lambda: torch.ops.deepinfer.rotary_embedding.default(positions, q, k, 128, cache, True))
    gate_up = torch.randn(1, 2 * HIDDEN, device="cuda", dtype=torch.bfloat16)
    out["torch.ops.deepinfer.silu_and_mul (1x2*4096)"] = lambda: torch.ops.deepinfer.silu_and_mul.default(gate_up)
    try:
        import flashinfer

        out["flashinfer.activation.silu_and_mul (1x2*4096)"] = lambda: flashinfer.activation.silu_and_mul(gate_up)
    except ImportError:
        pass
    if fast_path.loaded():
        # the Python kernels the C++ entry passes unserved calls to (under grad mode its Python
        # Autograd kernel goes down to the public op's CUDA kernel, which is the C++ entry)
        out["Python kernels (twin deepinfer_py::rmsnorm)"] = lambda: torch.ops.deepinfer_py.rmsnorm.default(x, w, EPS)
        out["Python out kernel (twin deepinfer_py::rmsnorm.out)"] = (
            lambda: torch.ops.deepinfer_py.rmsnorm.out(x, w, EPS, out=y))
    return out


def layers() -> list:
    with _tilelang_selected():
        table = cases(*_inputs())
        rows = []
        for mode, ctx in MODES:
            with ctx():
                times = harness.host_us_interleaved(table)
            peer = times["F.rms_norm"]
            rows += [{"case": name, "mode": mode, "host us": us, "over F.rms_norm": us - peer} for name, us in times.items()]
        return rows


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    rows = layers()
    counters = fast_path.counters()
    if args.out:
        harness.write_json(args.out, {**harness.header(), "cpp_entry": fast_path.status(), "counters": counters,
                                      "host_1x4096_bf16": rows})
    print(f"C++ entry: {fast_path.status()}; {counters}")
    print(harness.markdown(rows, ["case", "mode", "host us", "over F.rms_norm"]))
