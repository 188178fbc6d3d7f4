"""examples/paged_decoder_layer.py and benchmarks/bench_paged_layer.py: the paged-cache layer's fused
and unfused variants equal bit for bit (outputs and caches), the unfused one equal to the cacheless
layer on our ops, all close to plain torch, the caches written at the sequence's slots only, the
layer compiled in one graph, and the benchmark's CPU smoke run."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import decoder_layer  # noqa: E402
import paged_decoder_layer as paged  # noqa: E402

TINY = paged.TINY
#: Llama-shaped, narrower (head 128 as Qwen3's and Llama's)
NARROW = paged.Config(hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2816, max_position=4096)
PLAIN_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # relative, output and residual


def _run(layers, variant, cfg, tokens, device, dtype, num_blocks, seed=1):
    """``(outputs, caches, slot_mapping)`` of ``variant`` on fresh inputs and fresh random caches."""
    positions, hidden, slot_mapping = paged.paged_inputs(cfg, tokens, num_blocks, device, dtype, seed)
    layer = layers[variant]
    caches = layer.new_caches(num_blocks, torch.Generator().manual_seed(seed + 1))
    with torch.inference_mode():
        out = layer(positions, hidden, *caches, slot_mapping)
    return out, caches, slot_mapping


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 37])
def test_fused_equals_unfused_and_plain_on_cpu(qk_norm, dtype, tokens):
    layers = paged.build(TINY, dtype=dtype, qk_norm=qk_norm)
    num_blocks = 2 * -(-tokens // paged.BLOCK_SIZE) + 1
    (fused, fused_caches, slot_mapping), (unfused, unfused_caches, _), (plain, plain_caches, _) = (
        _run(layers, v, TINY, tokens, "cpu", dtype, num_blocks) for v in paged.VARIANTS)
    assert _equal(fused, unfused) and _equal(fused_caches, unfused_caches)
    for got, want in zip(fused, plain):
        assert decoder_layer.relative_error(got, want) < PLAIN_TOLERANCE[dtype]
    for got, want in zip(fused_caches, plain_caches):
        rows = got.flatten(0, 1)[slot_mapping], want.flatten(0, 1)[slot_mapping]
        assert decoder_layer.relative_error(*rows) < PLAIN_TOLERANCE[dtype]


def test_the_cache_holds_the_rotated_keys_and_nothing_else_changes():
    """Without QK-norm the fused paged layer returns what the cacheless layer on our ops returns, bit
    for bit (its keys and values went through the cache unchanged), and the cache rows of no slot of
    the sequence keep their random contents."""
    tokens, num_blocks, dtype = 37, 7, torch.bfloat16
    layers = paged.build(TINY, dtype=dtype)
    before = layers["fused"].new_caches(num_blocks, torch.Generator().manual_seed(2))
    out, caches, slot_mapping = _run(layers, "fused", TINY, tokens, "cpu", dtype, num_blocks)
    positions, hidden = decoder_layer.inputs(TINY, tokens, dtype=dtype, seed=1)
    with torch.inference_mode():
        want = decoder_layer.DecoderLayer(TINY, True, dtype=dtype)(positions, hidden)
    assert _equal(out, want)
    untouched = torch.ones(num_blocks * paged.BLOCK_SIZE, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert untouched.sum() == num_blocks * paged.BLOCK_SIZE - tokens
    for got, old in zip(caches, before):
        assert torch.equal(got.flatten(0, 1)[untouched], old.flatten(0, 1)[untouched])


def test_variants_refuse_unknown_ones_and_tables_refuse_short_caches():
    with pytest.raises(ValueError, match="variant must be one of"):
        paged.PagedDecoderLayer(TINY, "paged")
    with pytest.raises(ValueError, match="17 tokens need 2 blocks of 16; the cache has 1"):
        paged.block_table(17, 1)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_compiles_in_one_graph_with_our_ops_in_it(qk_norm):
    """``fullgraph`` (``aot_eager`` on the CPU): the fused layer compiled returns what it returns eagerly,
    the caches included, and its graph holds the fused op of its attention."""
    torch._dynamo.reset()
    layers = paged.build(TINY, dtype=torch.bfloat16, qk_norm=qk_norm)
    positions, hidden, slot_mapping = paged.paged_inputs(TINY, 21, 5, dtype=torch.bfloat16)
    eager_caches = layers["fused"].new_caches(5, torch.Generator().manual_seed(3))
    compiled_caches = tuple(c.clone() for c in eager_caches)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    with torch.inference_mode():
        want = layers["fused"](positions, hidden, *eager_caches, slot_mapping)
        got = torch.compile(layers["fused"], backend=backend, fullgraph=True)(positions, hidden, *compiled_caches,
                                                                                slot_mapping)
    assert _equal(got, want) and _equal(compiled_caches, eager_caches)
    code = graphs[0].code
    fused_op = "qk_rmsnorm_rope" if qk_norm else "rotary_embedding_and_cache"
    assert f"deepinfer.{fused_op}" in code, code


def test_benchmark_cpu_smoke_run(tmp_path):
    out = tmp_path / "paged.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_paged_layer.py"), "--device", "cpu",
                           "--tiny", "--tokens", "5", "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["tokens"], r["row"], r["qk_norm"]): r for r in json.loads(out.read_text())["rows"]}
    assert {row for _, row, _ in rows} == {"no cache, ours", "no cache, plain", "paged fused", "paged unfused", "paged plain"}
    for (tokens, row, qk_norm), r in rows.items():
        assert r["call us"] > 0 and r.get("error") is None, r
        if row in ("paged fused", "paged unfused"):
            assert r["= paged unfused"] is True, r
    assert "| paged fused |" in proc.stdout


# --- CUDA --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 300])
def test_fused_equals_unfused_on_cuda(qk_norm, tokens):
    """Without QK-norm the fused op and the unfused pair come from one backend each way: bit for bit.
    With it the unfused ops come from two backends (rmsnorm's and rotary_embedding's defaults): within
    the dtype's rounding of the fused op."""
    layers = paged.build(NARROW, "cuda", torch.bfloat16, qk_norm=qk_norm)
    num_blocks = 2 * -(-tokens // paged.BLOCK_SIZE) + 3
    (fused, fused_caches, _), (unfused, unfused_caches, _), (plain, _, _) = (
        _run(layers, v, NARROW, tokens, "cuda", torch.bfloat16, num_blocks) for v in paged.VARIANTS)
    if not qk_norm:
        assert _equal(fused, unfused) and _equal(fused_caches, unfused_caches)
    for got, want in zip((*fused, *fused_caches), (*unfused, *unfused_caches)):
        assert decoder_layer.relative_error(got, want) < 1e-2
    for got, want in zip(fused, plain):
        assert decoder_layer.relative_error(got, want) < PLAIN_TOLERANCE[torch.bfloat16]
