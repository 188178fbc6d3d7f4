"""How many slices a row the top-k/top-p kernels should take, and what the fused logits-in sampler saves,
on a CUDA GPU.

    python benchmarks/probe_sampling_slices.py --out results/probe_sampling_slices.json

fp32 probabilities (softmax of ``randn * 3``) and bf16 logits, rows x vocab, timed by CUDA-graph replay in
interleaved rounds: each Triton op with the slices its launch now fits to the call (``Config.slice_values``),
with the fixed 32 (``slice_values=0``), the top-k prepass at 64 slices or without its register cap, the
histogram kernel without its register cap or its floor of 32 slices (``CONFIGS``);
``top_k_top_p_sampling_from_logits`` fused and as softmax then the probs-in sampler; and FlashInfer's op
when installed. Our results are checked against the reference first (the ids exactly, the renormalised
rows to fp32 rounding); FlashInfer's ids against the reference's kept set."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kernels.bench import harness  # noqa: E402
from torch_kernels.families.sampling import reference  # noqa: E402
from torch_kernels.families.sampling import triton as triton_sampling  # noqa: E402
from torch_kernels.families.sampling.ops import kept_set  # noqa: E402
from torch_kernels.families.sampling.triton import logits_in  # noqa: E402

SHAPES = ((1, 32000), (32, 32000), (64, 32000), (256, 32000), (512, 32000), (256, 128256), (256, 256000))
TOP_K, TOP_P = 50, 0.9
CONFIGS = {"fitted slices": triton_sampling.DEFAULT,
           "32 slices": triton_sampling.DEFAULT._replace(slice_values=0, hist_slices=32),
           # at 256000 the top-k prepass's slices of 8000 values spill at 64 registers a thread (564 bytes
           # for sm_90); 64 slices keep 4000 but leave 64 slots (no group-maxima start at k = 50)
           "top-k prepass 64 slices": triton_sampling.DEFAULT._replace(slices=64),
           "top-k prepass, ptxas' registers": triton_sampling.DEFAULT._replace(slice_maxnreg=0),
           # _hist_kernel at ptxas' 110 registers a thread: 2 programs an SM, not 3 (the default's 80 spill 40 bytes)
           "histogram kernel, ptxas' registers": triton_sampling.DEFAULT._replace(hist_maxnreg=0),
           # the histogram route's slices fitted as the prepass's (8 a row at 256 x 32000), not at least 32
           "histogram route without its 32-slice floor": triton_sampling.DEFAULT._replace(hist_min_slices=0)}


def probs_in_calls(probs, seed, offset, fs):
    """``{op: ({label: fn}, check)}``: each op's Triton launches under ``CONFIGS`` and FlashInfer's."""
    B = probs.shape[0]
    k, p = torch.full((B,), TOP_K, device=probs.device), torch.full((B,), TOP_P, device=probs.device)
    launch = triton_sampling._launch
    ops = {
        "top_k_renorm_probs": ({n: lambda c=c: launch(probs, TOP_K, None, None, None, False, c) for n, c in CONFIGS.items()},
                               reference.top_k_renorm_probs(probs, k)),
        "top_p_renorm_probs": ({n: lambda c=c: launch(probs, None, TOP_P, None, None, False, c) for n, c in CONFIGS.items()},
                               reference.top_p_renorm_probs(probs, p)),
        "top_k_top_p_sampling_from_probs": (
            {n: lambda c=c: launch(probs, TOP_K, TOP_P, seed, offset, True, c) for n, c in CONFIGS.items()},
            reference.top_k_top_p_sampling_from_probs(probs, k, p, seed, offset)),
        "top_p_sampling_from_probs (top_k 0)": (
            {n: lambda c=c: launch(probs, 0, TOP_P, seed, offset, True, c) for n, c in CONFIGS.items()},
            reference.top_k_top_p_sampling_from_probs(probs, torch.zeros_like(k), p, seed, offset)),
    }
    if fs is not None:
        s, o = int(seed), int(offset)
        ops["top_k_renorm_probs"][0]["FlashInfer"] = lambda: fs.top_k_renorm_probs(probs, TOP_K)
        ops["top_p_renorm_probs"][0]["FlashInfer"] = lambda: fs.top_p_renorm_probs(probs, TOP_P)
        ops["top_k_top_p_sampling_from_probs"][0]["FlashInfer"] = lambda: fs.top_k_top_p_sampling_from_probs(
            probs, TOP_K, TOP_P, deterministic=True, seed=s, offset=o)
        ops["top_p_sampling_from_probs (top_k 0)"][0]["FlashInfer"] = lambda: fs.top_p_sampling_from_probs(
            probs, TOP_P, deterministic=True, seed=s, offset=o)
    return ops


def logits_in_calls(logits, seed, offset, fs):
    B = logits.shape[0]
    args = (None, TOP_K, None, TOP_P, None, 1.0, seed, offset)
    calls = {}
    for n, c in CONFIGS.items():
        calls[f"fused, {n}"] = lambda c=c: logits_in.top_k_top_p_sampling_from_logits(logits, *args, config=c)
        calls[f"softmax then probs-in, {n}"] = lambda c=c: triton_sampling._launch(
            triton_sampling.softmax(logits, None, 1.0), TOP_K, TOP_P, seed, offset, True, c)
    if fs is not None:
        s, o = int(seed), int(offset)
        calls["FlashInfer"] = lambda: fs.top_k_top_p_sampling_from_logits(logits, TOP_K, TOP_P, deterministic=True,
                                                                          seed=s, offset=o)
    want = reference.top_k_top_p_sampling_from_logits(logits, *args)
    k, p = torch.full((B,), TOP_K, device=logits.device), torch.full((B,), TOP_P, device=logits.device)
    return {"top_k_top_p_sampling_from_logits": (calls, want)}, reference.softmax(logits), k, p


def checked(op, calls, want, probs, k, p):
    """``calls`` with each result checked: ours against ``want``, FlashInfer's ids against the kept set."""
    if op.startswith("top_p_sampling"):
        k = torch.zeros_like(k)
    for label, fn in list(calls.items()):
        got = fn()
        if label == "FlashInfer":
            if got.dtype.is_floating_point:
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-7):  # its fp32 top-p boundary
                    calls["FlashInfer (another kept set)"] = calls.pop(label)
            elif not kept_set(probs, k, p).gather(1, got.long()[:, None]).all():
                raise SystemExit(f"FlashInfer's {op}: an id outside the reference's kept set")
        elif got.dtype.is_floating_point:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30, msg=lambda m: f"{op} {label}: {m}")
        elif not torch.equal(got, want):
            raise SystemExit(f"{op} {label} differs from the reference")
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fs = harness.optional_module("flashinfer.sampling")
    ceiling = harness.copy_ceiling_gbps()
    rows = []
    torch.manual_seed(0)
    seed, offset = torch.tensor(1234, device="cuda"), torch.tensor(0, device="cuda")
    for b, v in SHAPES:
        logits = torch.randn(b, v, device="cuda").mul_(3)
        probs = torch.softmax(logits, -1)
        k, p = torch.full((b,), TOP_K, device="cuda"), torch.full((b,), TOP_P, device="cuda")
        for op, (calls, want) in probs_in_calls(probs, seed, offset, fs).items():
            rows += harness.bandwidth_rows(op, f"{b}x{v}", checked(op, calls, want, probs, k, p), probs.numel() * 4,
                                           ceiling, 3)
        x = logits.to(torch.bfloat16)
        ops, soft, k, p = logits_in_calls(x, seed, offset, fs)
        for op, (calls, want) in ops.items():
            rows += harness.bandwidth_rows(op, f"{b}x{v}", checked(op, calls, want, soft, k, p), x.numel() * 2,
                                           ceiling, 3)
    harness.write_bandwidth_rows(args.out, ceiling, rows, ["op", "shape", "impl", "us", "GB/s", "of copy"])


if __name__ == "__main__":
    main()
