#!/usr/bin/env bash
# GPU validation on the lent Hopper machine: install, doctor, every GPU test, benchmarks.
# Usage (device): source .devbundle/setup.sh && bash scripts/gpu_validation.sh tests|bench|all|bwd|hf
# (bwd: the backward's GPU tests and its deterministic modes timed beside the default, in one call (BWD_PART=1|2: half
#  the tests each);
#  hf: the HF and ops GPU tests, then generation steps per layer, eager and compiled, and the eager host profile)
# Logs and results go to $OUT (or ./gpu_out).
# A newer transformers than the lent machine's (5.17): download its wheel and the few it needs newer (here:
#   python -m pip download --no-deps -d .peers/tf524min transformers==5.24.0 regex typer click rich shellingham \
#     markdown-it-py mdurl pygments annotated-doc --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64), carry it beside .devbundle (16 + 38 MB fit one carry), and before the tests
#   python3 -m pip install -q --no-deps --target /tmp/tf .peers/tf524min/*.whl; export PYTHONPATH=/tmp/tf:$PYTHONPATH
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
what="${1:-all}"
case $what in tests|bench|all|bwd|hf) ;; *) echo "usage: $0 tests|bench|all|bwd|hf" >&2; exit 2 ;; esac
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
if [ "$what" = bwd ]; then
  det='[{}, {"deterministic": true, "det_mode": "contrib_ws"}, {"deterministic": true, "det_mode": "contrib_bf16"}, {"deterministic": true, "det_mode": "contrib_i16"}, {"deterministic": true, "det_mode": "fixed"}]'
  # compile the backward programs side by side first: one after another the GPU file outlasts a call
  timeout 240 python benchmarks/kernels/bench_sparse_attention_bwd.py --warmup --jobs 16 --variants "$det" \
    >"$OUT/bwd_warmup.log" 2>&1
  tail -n 1 "$OUT/bwd_warmup.log"
  # the file outlasts one call (about 800 s on an H100 with 8-12 workers): BWD_PART=1 or 2 runs the first or second
  # half of its tests in collection order with 12 workers and no timing (two calls back to back keep the compiled
  # programs); unset runs all of them, then times the deterministic modes
  bwd_file=tests/kernels/test_sparse_attention_bwd_gpu.py
  bwd_tests=("$bwd_file") bwd_timeout=${TEST_TIMEOUT:-300} bwd_workers=${WORKERS:-6}
  if [ -n "${BWD_PART:-}" ]; then
    bwd_timeout=${TEST_TIMEOUT:-480} bwd_workers=${WORKERS:-12}
    case $BWD_PART in 1|2) ;; *) echo "BWD_PART must be 1 or 2, got $BWD_PART" >&2; exit 2 ;; esac
    mapfile -t bwd_ids < <(python -m pytest -q -p no:cacheprovider --collect-only "$bwd_file" \
      2>"$OUT/bwd_collect.log" | grep '::')
    [ ${#bwd_ids[@]} -gt 0 ] || { echo "collecting $bwd_file failed:" >&2; tail -n 20 "$OUT/bwd_collect.log" >&2; exit 1; }
    half=$(( (${#bwd_ids[@]} + 1) / 2 ))
    if [ "$BWD_PART" = 1 ]; then bwd_tests=("${bwd_ids[@]:0:half}"); else bwd_tests=("${bwd_ids[@]:half}"); fi
    echo "backward GPU tests, part $BWD_PART: ${#bwd_tests[@]} of ${#bwd_ids[@]}"
  fi
  timeout "$bwd_timeout" python -m pytest -q -p no:cacheprovider -n "$bwd_workers" --dist load -rfE \
    "${bwd_tests[@]}" 2>&1 | tee "$OUT/bwd_tests${BWD_PART:+_part$BWD_PART}.log" | tail -n 30
  if [ -z "${BWD_PART:-}" ]; then
    timeout "${BENCH_TIMEOUT:-240}" python benchmarks/kernels/bench_sparse_attention_bwd.py --det \
      --shapes mla_h64,mla_h128,v4_h128_sink,mla_h64_causal --variants "$det" --csv "$OUT/bwd_det.csv" \
      2>&1 | tee "$OUT/bwd_det.log" | grep "|"
  fi
fi
if [ "$what" = hf ]; then
  timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -p no:cacheprovider -n "${WORKERS:-10}" -rfE \
    tests/ops/test_ops_gpu.py tests/kernels/test_indexer_gpu.py tests/adapters/hf 2>&1 | tee "$OUT/hf_tests.log" | tail -n 8
  # eager: per layer from two depths (B 1); compiled (CUDA graphs): one layer, B 1 and 32
  timeout "${BENCH_TIMEOUT:-240}" python benchmarks/bench_hf_decode.py --contexts 4096,131072 --batches 1 \
    --modes eager_static,eager_dynamic --layers 1,4 --steps 40 --out "$OUT/eager" 2>&1 | tee "$OUT/hf_decode_eager.log" \
    | grep -E "ms/step|Error"
  timeout "${BENCH_TIMEOUT:-240}" python benchmarks/bench_hf_decode.py --contexts 131072,4096,65536 --batches 1,32 \
    --modes compiled_static --steps 60 --out "$OUT" 2>&1 | tee "$OUT/hf_decode.log" | grep -E "ms/step|Error"
  timeout 120 python benchmarks/profile_hf_decode_host.py 2>&1 | tee "$OUT/hf_eager_host.log" | tail -n 16
fi
