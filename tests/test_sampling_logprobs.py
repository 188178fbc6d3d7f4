"""``sampled_token_logprobs``: the reference against vLLM's two lines (log_softmax, gather and rank), every
backend against the reference (the rank exactly), edge rows, bad input named."""

import math

import pytest
import torch

import torch_kernels
from torch_kernels import ops, registry
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close

from conftest import DEVICES, assert_bad_inputs_raise, implementations_on

OP = "sampled_token_logprobs"
NINF = float("-inf")


def _vllm(logits, token_ids, temperature=1.0):
    """vLLM's ``compute_logprobs`` (log_softmax in fp32) and ``gather_logprobs`` (the token's and its rank)."""
    logprobs = (logits.float() / temperature).log_softmax(-1)
    token = logprobs.gather(-1, token_ids.long()[:, None])
    return token.squeeze(-1), (logprobs >= token).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_vllms_formula(dtype):
    torch.manual_seed(40)
    logits = (torch.randn(6, 3000) * 3).to(dtype)
    ids = torch.randint(0, 3000, (6,))
    ids[0] = logits[0].float().argmax()
    for t in (1.0, 0.7):
        got, rank = torch_kernels.sampled_token_logprobs(logits, ids, t)
        want, want_rank = _vllm(logits, ids, t)
        assert_close(got, want, dtype=torch.float32)
        # vLLM ranks on rounded log-probabilities: fp32 values within an ulp of the token's may merge
        assert (rank - want_rank).abs().max() <= (2 if dtype == torch.float32 else 0), (rank, want_rank)
        assert rank[0] == want_rank[0] >= 1


def test_edge_rows():
    x = torch.tensor([[1.0, 2.0, NINF, 2.0], [0.5, NINF, 3.0, -1.0], [1.0, 1.0, 1.0, 1.0], [NINF] * 4])
    ids = torch.tensor([1, 1, 9, 0])
    lp, rank = torch_kernels.sampled_token_logprobs(x, ids)
    assert rank.tolist() == [2, 4, 0, 4]  # ties counted; a -inf token ranks below every value; out of range: 0
    assert lp[0] == pytest.approx(2.0 - math.log(math.e + 2 * math.e ** 2)) and lp[1] == NINF
    assert math.isnan(lp[2]) and math.isnan(lp[3])  # an id outside the vocabulary; a row of all -inf
    lp0, rank0 = torch_kernels.sampled_token_logprobs(x[:2], torch.tensor([0, 3]), 0.0)  # uniform over finite
    assert lp0.tolist() == pytest.approx([-math.log(3)] * 2) and rank0.tolist() == [3, 3]


def _cuda_cases():
    for vocab, rows in ((128256, 64), (32000, 5), (256000, 3)):
        logits = torch.randn(rows, vocab, device="cuda") * 3
        logits[0, ::7] = NINF
        ids = torch.randint(0, vocab, (rows,), device="cuda")
        yield logits, ids, None, 1.0
        yield logits.bfloat16(), ids.int(), torch.rand(rows, device="cuda") + 0.3, 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_backends_match_reference(device):
    torch.manual_seed(41)
    ref = registry.BY_OP[OP][Backend.TORCH].load()
    cases = [tuple(a) for dtype in (torch.float32, torch.float16) for a in ops.BY_NAME[OP].samples(device, dtype)]
    if device == "cuda":
        cases += list(_cuda_cases())
    for args in cases:
        want_lp, want_rank = ref(*args)
        for name, fn in implementations_on(OP, device):
            lp, rank = fn(*args)
            what = f"{name} {tuple(args[0].shape)} {args[0].dtype}"
            assert lp.dtype == torch.float32 and rank.dtype == torch.int64, what
            assert torch.equal(rank.cpu(), want_rank.cpu()), f"{what}: ranks {rank.tolist()} vs {want_rank.tolist()}"
            assert_close(lp.cpu(), want_lp.cpu(), msg=what)


def test_bad_input_names_the_op_and_the_argument():
    logits, ids = torch.randn(4, 64), torch.tensor([1, 2, 3, 4])
    assert_bad_inputs_raise(OP, [
        ("1-D logits", (logits[0], ids, None, 1.0), ValueError, "logits"),
        ("fp64 logits", (logits.double(), ids, None, 1.0), TypeError, "logits"),
        ("float ids", (logits, ids.float(), None, 1.0), TypeError, "token_ids"),
        ("ids of the wrong length", (logits, ids[:3], None, 1.0), ValueError, "token_ids"),
        ("ids on another device", (logits, ids.to("meta"), None, 1.0), ValueError, "token_ids"),
        ("int temperatures", (logits, ids, ids, 1.0), TypeError, "maybe_temperature_arr"),
        ("negative temperature", (logits, ids, None, -1.0), ValueError, "temperature_val"),
    ])
    with pytest.raises(TypeError, match=rf"^deepinfer::{OP}: argument 'temperature' "):
        torch_kernels.sampled_token_logprobs(logits, ids, "0.7")
