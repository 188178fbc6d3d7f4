#!/usr/bin/env bash
# One GPU-host session, results under OUT (8 files come back from the device tool, so results travel
# as archives):
#   bash benchmarks/gpu_session.sh tests OUT            # the gpu tests in 15 parallel shards, then python -m torch_kernels
#   bash benchmarks/gpu_session.sh suite OUT            # python -m torch_kernels tune, then the bench suite under auto
#   bash benchmarks/gpu_session.sh bench OUT [names]    # benchmarks/bench_<name>.py (default: all)
# BUDGET=<seconds> stops starting new steps once that much time has passed; TESTS="<pytest args>"
# narrows the test run (default: tests/), SHARDS=<n> sets its processes (default 15, for 16 cores). On the H200 (2026-11-29): tune 119-127 s,
# the suite 114-131 s; the gpu tests 190 s in 24 shards (32 cores), 258 s in 16 beside the suite on the
# other GPU (TileLang's nvcc dominates); python -m torch_kernels 98 s.
# Two GPUs (kind nvidia-h200-x2): CUDA_VISIBLE_DEVICES=0 ... suite & CUDA_VISIBLE_DEVICES=1 ... tests &
# Needs the bundles of shared/gpu/README.md (. .gpu-pkgs/setup.sh); expecttest travels in .gpu-pkgs/extra.
set -uo pipefail
what=${1:?tests|suite|bench}; out=${2:?output folder}; budget=${BUDGET:-100000}
. .gpu-pkgs/setup.sh
export PYTHONPATH=$PYTHONPATH:$(pwd)/.gpu-pkgs/extra
python -m torch_kernels build 2>&1 | tail -2  # the C++ entry of the norm and activation ops (fast_path.py); instant once built
left() { echo $((budget - SECONDS)); }
if [ "$what" = tests ]; then
  SHARD_BY=item bash benchmarks/gpu_parallel_tests.sh "$out" "$(( $(left) > 300 ? $(left) - 120 : $(left) ))" ${SHARDS:-15} ${TESTS:-tests/} \
    | sort | uniq -c | sort -rn | head -30
  [ "$(left)" -gt 30 ] && { timeout "$(left)" python -m torch_kernels > "$out/main.txt" 2>&1; echo "main rc=$?" | tee -a "$out/main.txt"; grep -vE " ok$" "$out/main.txt" | tail -25; }
elif [ "$what" = suite ]; then
  export DEEPINFER_OPS_TUNE_DIR=$out/table
  timeout "$(left)" python -m torch_kernels tune --budget $(( $(left) / 2 )) --out "$out/tune" > "$out/tune.log" 2>&1
  echo "tune rc=$? at ${SECONDS}s"; grep -E "^\[tune\]" "$out/tune.log"
  DEEPINFER_OPS_BACKEND=auto timeout "$(left)" python -m torch_kernels bench --budget $(( $(left) - 60 )) --out "$out/suite" > "$out/bench.log" 2>&1
  echo "bench rc=$? at ${SECONDS}s"; grep -E "^\[bench\]" "$out/bench.log"; sed -n '/## Goals/,/^## [a-z]/p' "$out"/suite/*.md | head -45
  rm -f "$out"/table/*.lock; tar czf "$out/results.tgz" -C "$out" suite tune && rm -rf "$out/suite" "$out/tune"
else
  mkdir -p "$out/b"
  names=${3:-$(ls benchmarks/bench_*.py | sed 's|benchmarks/bench_||; s|\.py$||')}
  for name in $names; do
    [ "$(left)" -gt 20 ] || { echo "== $name: not run (budget)"; continue; }
    timeout "$(left)" python "benchmarks/bench_$name.py" --out "$out/b/$name.json" > "$out/b/$name.md" 2>&1
    echo "== $name rc=$? at ${SECONDS}s"; tail -n 22 "$out/b/$name.md"
    tar czf "$out/bench.tgz" -C "$out/b" .  # after every benchmark: a run cut short still returns what it has
  done
  rm -rf "$out/b"
fi
