#!/usr/bin/env bash
# One GPU-host session: the gpu tests and the self-check, or every benchmark, with results under OUT.
#   bash benchmarks/gpu_session.sh tests "$OUT"     # pytest -m gpu + python -m torch_kernels
#   bash benchmarks/gpu_session.sh bench "$OUT" [names]   # benchmarks/bench_<name>.py (default all) -> OUT/bench.tgz
# Needs the bundles of shared/gpu/README.md (. .gpu-pkgs/setup.sh); expecttest travels in .gpu-pkgs/extra.
set -uo pipefail
what=${1:?tests|bench}; out=${2:?output folder}
. .gpu-pkgs/setup.sh
export PYTHONPATH=$PYTHONPATH:$(pwd)/.gpu-pkgs/extra
if [ "$what" = tests ]; then
  timeout 420 python -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests/ > "$out/pytest_gpu.txt" 2>&1
  echo "pytest rc=$?" | tee -a "$out/pytest_gpu.txt"
  grep -E "passed|failed|FAILED|Error" "$out/pytest_gpu.txt" | tail -30
  timeout 150 python -m torch_kernels > "$out/main.txt" 2>&1
  echo "main rc=$?" | tee -a "$out/main.txt"
  grep -vE " ok$" "$out/main.txt" | tail -30
else
  mkdir -p "$out/b"
  names=${3:-$(ls benchmarks/bench_*.py | sed 's|benchmarks/bench_||; s|\.py$||')}
  for name in $names; do
    b=benchmarks/bench_$name.py
    timeout 150 python "$b" --out "$out/b/$name.json" > "$out/b/$name.md" 2>&1
    echo "== $name rc=$?"; tail -n 25 "$out/b/$name.md"
  done
  tar czf "$out/bench.tgz" -C "$out/b" . && rm -rf "$out/b"
fi
