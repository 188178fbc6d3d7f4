#!/usr/bin/env bash
# The `gpu` tests on the GPU host in N concurrent pytest processes (DEEPINFER_TEST_SHARD=i/N, whole
# test functions per shard: tests/conftest.py), results in OUT/p<i>.txt. Most of their time is
# TileLang's nvcc compiles (2.5-3 s a specialisation, one process each): four processes over whole
# files ran past 320 s (2026-11-29), so the host's 16 cores take 14 shards; the kernels' disk cache
# is safe to share.
#   bash benchmarks/gpu_parallel_tests.sh OUT [seconds] [shards] [pytest args]
# SHARD_BY=item shares out single tests instead of whole functions.
set -uo pipefail
out=${1:?output folder}; limit=${2:-540}; n=${3:-14}; shift $(( $# < 3 ? $# : 3 ))
logs=$(mktemp -d)
. .gpu-pkgs/setup.sh
export PYTHONPATH=$PYTHONPATH:$(pwd)/.gpu-pkgs/extra
python -m torch_kernels build 2>&1 | tail -2  # the C++ entry of the norm and activation ops (fast_path.py); instant once built
for ((i = 0; i < n; i++)); do
  ( DEEPINFER_TEST_SHARD=$i/$n${SHARD_BY:+/$SHARD_BY} timeout "$limit" python -m pytest -m gpu -q -p no:cacheprovider --durations=3 "${@:-tests/}" \
      > "$logs/p$i.txt" 2>&1; echo "rc=$?" >> "$logs/p$i.txt" ) &
done
wait
for ((i = 0; i < n; i++)); do grep -hE " passed| failed|^FAILED|^ERROR|rc=" "$logs/p$i.txt" | tail -8; done
tar czf "$out/tests.tgz" -C "$logs" .
