#!/usr/bin/env bash
# The `gpu` tests on a CUDA machine in N concurrent pytest processes (DEEPINFER_TEST_SHARD=i/N, whole
# test functions per shard: tests/conftest.py), in the active environment (see docs/benchmarks/README.md),
# logs in OUT/p<i>.txt and OUT/tests.tgz. Most of their time is nvcc compiling TileLang kernels (2.5-3 s
# a specialisation on an H200's host, one process each), so about one shard a core; the kernels' disk
# cache is safe to share.
#   bash benchmarks/gpu_parallel_tests.sh OUT [seconds per shard] [shards] [pytest args]
# SHARD_BY=item shares out single tests instead of whole functions. Exits 1 when a shard fails.
set -uo pipefail
out=${1:?output folder}; limit=${2:-900}; n=${3:-$(nproc)}; shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out"
python -m torch_kernels build 2>&1 | tail -2  # the C++ entry of the norm and activation ops; instant once built
for ((i = 0; i < n; i++)); do
  ( DEEPINFER_TEST_SHARD=$i/$n${SHARD_BY:+/$SHARD_BY} timeout "$limit" python -m pytest -m gpu -q -p no:cacheprovider --durations=3 "${@:-tests/}" \
      > "$out/p$i.txt" 2>&1; echo "rc=$?" >> "$out/p$i.txt" ) &
done
wait
status=0
for ((i = 0; i < n; i++)); do
  grep -hE " passed| failed|^FAILED|^ERROR|rc=" "$out/p$i.txt" | tail -8
  # pytest's 5: no test of this shard selected
  grep -qxE "rc=(0|5)" "$out/p$i.txt" || status=1
done
tar czf "$out/tests.tgz" -C "$out" $(cd "$out" && ls p*.txt)
exit "$status"
