#!/usr/bin/env bash
# Device-machine entry: make the repo importable as `kvserving` without installing,
# carry FlashInfer wheels if present, run the gpu tests, then the benchmark.
# Usage (repo root): bash bench/gpu_run.sh [tests|bench|all] [bench args...]
set -u
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PKG=/tmp/kvpkg; rm -rf $PKG; mkdir -p $PKG/kvserving
cp -r common/. $PKG/kvserving/
for sub in kernels worker gateway operator; do ln -s "$PWD/$sub" $PKG/kvserving/$sub; done
export PYTHONPATH=$PKG
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PKG:/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gluon_decode.py tests/kernels/test_triton_paged.py 2>&1 | tee $OUT/gpu_tests.log | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/decode_gpu.py --out $OUT/decode_gpu.json "$@" 2>&1 | tee $OUT/bench.log
fi
if [ "$what" = ncu ]; then  # profile one decode launch per format named in "$@"
  (cd bench && timeout 400 ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip ${NCU_SKIP:-3} --launch-count ${NCU_COUNT:-1} \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
    python3 profile_decode.py "$@") > $OUT/ncu.txt 2>&1
  grep -vE "^\s*-+\s*$|^\s*$" $OUT/ncu.txt | grep -E "regs|_decode_kernel|Duration|Throughput|Occupancy|Registers|Issue|Ipc|Bank|Pipe|Eligible|Warp Cycles|Block Limit|Hit Rate|Busy|Shared Memory|Stall|Executed Instructions" | cut -c1-140
fi
