#!/usr/bin/env bash
# The `gpu` tests on the GPU host in four concurrent pytest processes over disjoint files, results in
# OUT/p<i>.txt. Most of their time is TileLang's nvcc compiles (2.5-3 s a kernel, one process each),
# which the host's 16 cores run side by side; the kernels' disk cache is safe to share.
#   bash benchmarks/gpu_parallel_tests.sh OUT [seconds]
set -uo pipefail
out=${1:?output folder}; limit=${2:-540}
. .gpu-pkgs/setup.sh
export PYTHONPATH=$PYTHONPATH:$(pwd)/.gpu-pkgs/extra
groups=("tests/test_norm.py tests/test_tilelang.py tests/test_dispatch.py tests/test_bench.py"
        "tests/test_activation.py tests/test_rope.py tests/test_registration.py"
        "tests/test_quant.py tests/test_attention.py tests/test_moe.py $(ls tests/test_tilelang_ops.py 2>/dev/null)"
        "tests/test_sampling.py tests/test_flashinfer.py tests/test_compile.py")
for i in "${!groups[@]}"; do
  ( timeout "$limit" python -m pytest -m gpu -q -p no:cacheprovider --durations=5 ${groups[$i]} > "$out/p$i.txt" 2>&1
    echo "rc=$?" >> "$out/p$i.txt" ) &
done
wait
for i in "${!groups[@]}"; do echo "== ${groups[$i]}"; grep -E "passed|failed|^FAILED|^ERROR|rc=" "$out/p$i.txt" | tail -12; done
