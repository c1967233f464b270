#!/usr/bin/env bash
# GPU validation on the lent Hopper machine: install, doctor, every GPU test, benchmarks.
# Usage (device): source .devbundle/setup.sh && bash scripts/gpu_validation.sh tests|bench|all
# Logs and results go to $OUT (or ./gpu_out).
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
what="${1:-all}"
python -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python -m dsa_plugins doctor 2>&1 | tee "$OUT/doctor.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >>"$OUT/doctor.txt" 2>&1
if [ "$what" = tests ] || [ "$what" = all ]; then
  # fill TileLang's disk cache for the forward family in parallel, then spread the tests over
  # workers so the remaining compilations (backward, indexer) also run side by side
  timeout 240 python benchmarks/kernels/bench_sparse_attention_fwd.py --precompile >"$OUT/precompile.log" 2>&1
  timeout "${TEST_TIMEOUT:-480}" python -m pytest -q -m gpu -p no:cacheprovider -n "${WORKERS:-6}" --dist load \
    --durations=15 -rfE tests \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 60
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_TIMEOUT:-420}" python -m dsa_plugins bench --suite "${SUITE:-all}" --out "$OUT" --tag "${TAG:-kernels}" \
    2>&1 | tee "$OUT/bench.log" | tail -n 40
fi
