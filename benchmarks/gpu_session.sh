#!/usr/bin/env bash
# One GPU-host session, results under OUT (8 files come back from the device tool, so the
# benchmark results travel as one bench.tgz):
#   bash benchmarks/gpu_session.sh tests OUT            # pytest -m gpu, then python -m torch_kernels
#   bash benchmarks/gpu_session.sh bench OUT [names]    # benchmarks/bench_<name>.py (default: all)
# BUDGET=<seconds> stops starting new steps once that much time has passed; TESTS="<pytest args>"
# narrows the test run (default: tests/).
# Needs the bundles of shared/gpu/README.md (. .gpu-pkgs/setup.sh); expecttest travels in .gpu-pkgs/extra.
set -uo pipefail
what=${1:?tests|bench}; out=${2:?output folder}; budget=${BUDGET:-100000}
. .gpu-pkgs/setup.sh
export PYTHONPATH=$PYTHONPATH:$(pwd)/.gpu-pkgs/extra
left() { echo $((budget - SECONDS)); }
if [ "$what" = tests ]; then
  timeout "$(left)" python -m pytest -m gpu -q -p no:cacheprovider --durations=10 ${TESTS:-tests/} > "$out/pytest_gpu.txt" 2>&1
  echo "pytest rc=$?" | tee -a "$out/pytest_gpu.txt"
  grep -E "passed|failed|FAILED|^E  " "$out/pytest_gpu.txt" | tail -30
  [ "$(left)" -gt 30 ] && { timeout "$(left)" python -m torch_kernels > "$out/main.txt" 2>&1; echo "main rc=$?" | tee -a "$out/main.txt"; grep -vE " ok$" "$out/main.txt" | tail -25; }
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
