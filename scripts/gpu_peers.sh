#!/usr/bin/env bash
# Same-run peer measurements on the lent Hopper machine: FlashMLA and cuDNN frontend beside ours.
# Staging (here, once): bash ../shared/device/stage_cudnn_fe.sh; bash ../shared/device/stage_flashmla.sh <snapshot>
# Device calls, back to back (the machine is given back after ~30 s idle):
#   1. carry [.devbundle, .peers/flashmla, scripts]        bash scripts/gpu_peers.sh start
#      (installs the package; builds FlashMLA in the background unless .peers/flashmla/built.tar.gz is
#      carried, then fills TileLang's disk cache for the GLM-5 / V3.2 / V4 kernels)
#   2. carry [.peers/cudnn_fe/setup.sh, .peers/cudnn_fe/part-aa]   source .peers/cudnn_fe/setup.sh
#   3. carry [.peers/cudnn_fe/setup.sh, .peers/cudnn_fe/part-ab]   source .peers/cudnn_fe/setup.sh
#      (a carry holds 64 MiB with the working tree, ~5.4 MB now: a 60 MiB part no longer fits. Stage smaller parts,
#      `sed 's/split -b 60M/split -b 42M/' ../shared/device/stage_cudnn_fe.sh | bash`, and carry part-ac too)
#   4. carry [.devbundle, .peers/flashmla, .peers/cudnn_fe/setup.sh, scripts]
#      GIT=<sha> bash scripts/gpu_peers.sh bench      (decode, forward and backward vs the peers)
#   5. same carry, GIT=<sha> bash scripts/gpu_peers.sh layer   (megatron 0.19 layer at 8K, three backends)
# Results come back as $OUT/results.tgz (csv/md per benchmark); $OUT/flashmla_built.tar.gz is the built
# peer: put it at .peers/flashmla/built.tar.gz to skip the build next time.
set -uo pipefail
stage=${1:?start, bench or layer}
RES=/tmp/peer_results; mkdir -p "$RES"
peers() {  # the order matters: cuDNN's site first, then the bundle's TileLang stack ahead of it
  [ -f .peers/cudnn_fe/setup.sh ] && source .peers/cudnn_fe/setup.sh
  source .devbundle/setup.sh
  [ -f /tmp/chain.done ] || { echo "waiting for the start stage's background work"; while [ ! -f /tmp/chain.done ]; do sleep 3; done; }
  source .peers/flashmla/setup.sh
  export DSA_PLUGINS_GIT=${GIT:-}
}
case $stage in
start)
  source .devbundle/setup.sh
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
  cat > /tmp/chain.sh <<'CH'
source .devbundle/setup.sh
source .peers/flashmla/setup.sh
DSA_PLUGINS_DECODE_PART_SLOTS=512 python3 -m dsa_plugins warmup glm5 deepseek_v32 deepseek_v4 --jobs 16 2>&1 | tail -n 3
touch /tmp/chain.done
CH
  setsid nohup bash /tmp/chain.sh > /tmp/chain.log 2>&1 < /dev/null &
  echo "started: FlashMLA (build or unpack) and the kernel warm-up run in the background"
  ;;
bench)
  peers
  if [ -n "${OUT:-}" ] && [ ! -f .peers/flashmla/built.tar.gz ]; then
    (cd /tmp/flashmla && tar -czf "$OUT/flashmla_built.tar.gz" $(find flash_mla -name '*.so'))
  fi
  timeout 200 python3 benchmarks/kernels/bench_sparse_attention_decode.py --heads 64,128 --batches 1,8,32,64 \
    --cache 32768 --part-slots 512,1024 --out "$RES" 2>&1 | grep -v Warning
  timeout 330 python3 benchmarks/peers/bench_attention_peers.py --modes fwd,bwd --shapes 8k --out "$RES" 2>&1 | grep -v Warning
  tar -czf "${OUT:-/tmp}/results.tgz" -C "$RES" .
  ;;
layer)
  peers
  timeout 300 python3 benchmarks/bench_megatron019_layer.py --seqlens 8192 \
    --providers tilelang,megatron_tilelang,megatron_cudnn --out "$RES" 2>&1 | grep -v -i warn | tail -n 12
  tar -czf "${OUT:-/tmp}/results.tgz" -C "$RES" .
  ;;
*) echo "unknown stage $stage"; exit 2;;
esac
