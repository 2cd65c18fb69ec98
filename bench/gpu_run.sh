#!/usr/bin/env bash
# Device-machine entry: make the repo importable as `kvserving` without installing (bench/device_env.sh),
# carry FlashInfer wheels if present, run the gpu tests, then the benchmark.
# Usage (repo root): bash bench/gpu_run.sh [STEPS] [bench args...]
#   STEPS: comma-separated tests, bench (decode_gpu.py), extend (extend_gpu.py), engine (engine_gpu.py: the engine
#   table with bf16 weights and its breakdown, then with FP8 block weights, sections default and weights_fp8_block of
#   $OUT/engine_gpu.json; ENGINE_TABLE_ARGS, default '--speed-kv-gib 40', T_ENGINE caps each run), nixl (nixl_read_gpu.py: the READ
#   between two processes on the GPU and the transport UCX chose), agents (agents.py --gpu with AGENTS_ARGS, default
#   fp8 at 12,16,24 agents; its stacks' logs tarred into $OUT), pdl (engine_gpu.py with KVSERVING_PDL=0, 1, 0, 1:
#   programmatic dependent launch off and on, twice, sections pdl<P>_<i> of $OUT/engine_pdl.json; ENGINE_ARGS, default
#   '--quick --no-breakdown --speed-kv-gib 40', fits an H100; T_AB caps each run, AB_PAIRS sets how many off-on pairs,
#   default 2), gemv (bf16 weights at 1-16 tokens: fp8_gemm_gpu.py --tokens 1,2,8,16, its bf16_gemv and bf16_tiles
#   paths against cuBLAS, then the engine bench with KVSERVING_BF16_GEMV=0, 1, 0, 1 as the pdl step runs it, sections
#   gemv<V>_<i> of $OUT/engine_gemv.json), layout (kv_cache.layout layer_major vs page_major: the READ bench with
#   each, $OUT/nixl_read_<layout>.json, then the engine bench alternated twice, sections <layout>_<i> of
#   $OUT/engine_layout.json; LAYOUT_ARGS, default '--quick --no-breakdown --speed-kv-gib 40 --formats
#   nvfp4,triaxial'), merge (the engine bench with KVSERVING_FUSED_MERGE=0, 1, 0, 1: the Gluon decode's splits merged
#   by a launch of their own or in the kernel, sections merge<M>_<i> of $OUT/engine_merge.json; ENGINE_ARGS as for
#   pdl), all (= tests,bench), ncu (one decode launch per format named in the bench args, at 32x32768 or
#   SHAPE=BxCONTEXT) or ncux (the extend launches of profile_extend.py's NCUX_ARGS, default 'nvfp4 tri fi': nvfp4,
#   triaxial, FlashInfer bf16); NCU_METRICS=m1,m2 (ncu --metrics, regex: allowed) adds metrics to both.
#   TESTS=paths limits the gpu tests (default: every test file under tests/ that holds a gpu-marked test, so the tests
#   step runs the whole gpu suite: GPU_WORKERS processes side by side, default 6, then the gpu_alone tests one at a
#   time); the Python packages those files import beyond torch and triton come as wheels in
#   .whl/ (docs/results.md, "Device machine": the list), installed with --target into /tmp/site and put on PYTHONPATH;
#   a module still missing is named before the tests run. WARM_FI=1 JIT-compiles FlashInfer's prefill in the
#   background while the tests and the decode bench run; T_TESTS / T_BENCH / T_EXTEND cap each step's seconds.
#   PRE_VARIANTS=a,b compiles those extend_gpu.py variants side by side (one process each, at 512 new on 1K cached:
#   the bench's specialization) while the tests run; PAR_TESTS="args1;args2" runs those pytest sets side by side with
#   the tests step (logs in $OUT/par_tests.log; each set is split on spaces, so name tests by node ids: a -k
#   expression with spaces does not survive). Both are waited for before the extend step.
# Exits non-zero (with one line saying why) when there is no GPU, and when a step fails.
set -uo pipefail
what=${1:-all}; shift || true
[ "$what" = all ] && what=tests,bench
for step in ${what//,/ }; do
  case "$step" in tests|bench|extend|engine|nixl|agents|pdl|merge|gemv|layout|ncu|ncux) ;; *) echo "gpu_run.sh: error: unknown step '$step' (tests, bench, extend, engine, nixl, agents, pdl, merge, gemv, layout, all, ncu or ncux)" >&2; exit 2;; esac
done
has() { [[ ",$what," == *",$1,"* ]]; }
fail() { echo "gpu_run.sh: error: $*" >&2; exit 1; }
command -v nvidia-smi >/dev/null 2>&1 || fail "no GPU: nvidia-smi not found (run this on the device machine)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || fail "no GPU: nvidia-smi failed"
source bench/device_env.sh  # $OUT, the package on PYTHONPATH, the carried wheels
# the gpu suite: every test file with a gpu-marked test (collecting a whole folder would import files with no gpu
# test, and their imports, too)
GPU_TESTS=$(grep -rlE --include='test_*.py' 'mark\.gpu|pytestmark.*gpu' tests | sort | tr '\n' ' ')
TESTS=${TESTS:-$GPU_TESTS}
# what those files (and the worker's HTTP server they start) import beyond torch / triton, named here if missing
python3 -c "
import importlib.util
mods = 'fastapi uvicorn click h11 starlette pydantic httpx openai prometheus_client aiohttp transformers tokenizers safetensors'
missing = [m for m in mods.split() if importlib.util.find_spec(m) is None]
if missing:
    print('gpu_run.sh: warning: not importable:', ' '.join(missing), '(carry their wheels in .whl/: docs/results.md)')"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); assert torch.cuda.is_available()" \
  || fail "no GPU visible to torch (or torch/triton missing)"
status=0
warm=""
if [ "${WARM_FI:-0}" = 1 ]; then python3 bench/extend_gpu.py --warm > $OUT/warm_fi.log 2>&1 & warm=$!; fi
bg=""
for v in ${PRE_VARIANTS:+${PRE_VARIANTS//,/ }}; do
  timeout ${T_TESTS:-420} python3 bench/extend_gpu.py --no-read --no-before --prefixes 1024 --chunks 512 --formats nvfp4,triaxial \
    --variants "$v" --out /tmp/pre_$v.json > /tmp/pre_$v.log 2>&1 & bg="$bg $!"
done
par=""
if [ -n "${PAR_TESTS:-}" ]; then
  IFS=';' read -ra sets <<< "$PAR_TESTS"
  for i in "${!sets[@]}"; do
    timeout ${T_TESTS:-420} python3 -m pytest -q -p no:cacheprovider -m gpu ${sets[$i]} > /tmp/par_$i.log 2>&1 & par="$par $!:$i"
  done
fi
if has tests; then
  # two parts: the gpu tests that share the GPU run side by side in GPU_WORKERS processes (pytest-xdist, a file to a
  # process: Triton's cold compiles are most of the suite's time), then the gpu_alone ones (the Qwen3-8B shape, two
  # worker processes) one at a time; T_TESTS caps both together. Exit 5 (nothing selected) is not a failure.
  jobs=${GPU_WORKERS:-6}
  python3 -c "import xdist" 2>/dev/null || jobs=1
  shared=(-m "gpu and not gpu_alone"); [ "$jobs" -gt 1 ] && shared+=(-n "$jobs" --dist loadfile)
  start=$SECONDS; : > $OUT/gpu_tests.log; rc=0
  for part in shared alone; do
    if [ $part = shared ]; then args=("${shared[@]}"); else args=(-m "gpu and gpu_alone"); fi
    left=$(( ${T_TESTS:-560} - (SECONDS - start) )); [ $left -gt 10 ] || left=10
    timeout $left python3 -m pytest -q -p no:cacheprovider "${args[@]}" $TESTS 2>&1 | tee -a $OUT/gpu_tests.log | tail -40
    prc=${PIPESTATUS[0]}; [ "$prc" = 0 ] || [ "$prc" = 5 ] || [ "$rc" != 0 ] || rc=$prc
  done
  [ "$rc" = 0 ] || { echo "gpu_run.sh: error: gpu tests failed (exit $rc, log in $OUT/gpu_tests.log)" >&2; status=1; }
fi
for job in $par; do
  wait ${job%%:*}; rc=$?; i=${job##*:}
  { echo "== PAR_TESTS $i: ${sets[$i]} (exit $rc)"; cat /tmp/par_$i.log; } >> $OUT/par_tests.log
  echo "PAR_TESTS $i (exit $rc): $(tail -1 /tmp/par_$i.log)"
  [ "$rc" = 0 ] || { echo "gpu_run.sh: error: PAR_TESTS $i failed (exit $rc, log in $OUT/par_tests.log)" >&2; status=1; }
done
for pid in $bg; do wait $pid || echo "gpu_run.sh: a PRE_VARIANTS compile failed (exit $?)"; done
for v in ${PRE_VARIANTS:+${PRE_VARIANTS//,/ }}; do grep -h "failed" /tmp/pre_$v.log; done
if has bench; then
  timeout ${T_BENCH:-600} python3 bench/decode_gpu.py --out $OUT/decode_gpu.json "$@" 2>&1 | tee $OUT/bench.log
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "gpu_run.sh: error: decode benchmark failed (exit $rc, log in $OUT/bench.log)" >&2; status=1; }
fi
if has extend; then
  [ -n "$warm" ] && { wait $warm; cat $OUT/warm_fi.log; warm=""; }
  timeout ${T_EXTEND:-600} python3 bench/extend_gpu.py --out $OUT/extend_gpu.json ${EXTEND_ARGS:-} 2>&1 | tee $OUT/extend.log
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "gpu_run.sh: error: extend benchmark failed (exit $rc, log in $OUT/extend.log)" >&2; status=1; }
fi
if has engine; then  # the engine table (bf16 weights, with the breakdown), then with FP8 block weights: one file
  for weights in bf16 fp8_block; do
    extra=(); [ $weights = fp8_block ] && extra=(--weights fp8_block --no-breakdown)
    timeout ${T_ENGINE:-280} python3 bench/engine_gpu.py ${ENGINE_TABLE_ARGS:---speed-kv-gib 40} "${extra[@]}" --out $OUT/engine_gpu.json \
      > $OUT/engine_$weights.log 2>&1
    rc=$?; echo "== engine, $weights weights (exit $rc)"; sed -n '/^format/,$p' $OUT/engine_$weights.log
    [ "$rc" = 0 ] || { echo "gpu_run.sh: error: engine_gpu.py failed with $weights weights (exit $rc, log in $OUT/engine_$weights.log)" >&2; status=1; }
  done
fi
nixl_ok=1
if has nixl; then  # the READ between two processes on the GPU must go over CUDA IPC, or the agent points measure TCP
  timeout ${T_NIXL:-240} python3 bench/nixl_read_gpu.py --require-transport cuda_ipc --out $OUT/nixl_read_gpu.json 2>&1 | grep -v '^\[' | tee $OUT/nixl.log
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "gpu_run.sh: error: nixl_read_gpu.py failed (exit $rc, log in $OUT/nixl.log)" >&2; status=1; nixl_ok=0; }
fi
if has agents && [ "$nixl_ok" = 0 ]; then
  echo "gpu_run.sh: error: agents step skipped: the READ between two processes on the GPU is not over CUDA IPC" >&2
elif has agents; then
  (cd bench && timeout ${T_AGENTS:-560} python3 agents.py --gpu ${AGENTS_ARGS:---formats fp8 --modes lease --concurrency 12,16,24 --point-s 110} \
    --json $OUT/agents_gpu.json --run-dir /tmp/agents_run > $OUT/agents.log 2>&1)
  rc=$?; tail -12 $OUT/agents.log
  [ -d /tmp/agents_run ] && tar czf $OUT/agents_run.tgz -C /tmp agents_run
  [ "$rc" = 0 ] || { echo "gpu_run.sh: error: agents.py failed (exit $rc, log in $OUT/agents.log)" >&2; status=1; }
fi
engine_ab() {  # the engine bench with environment variable $1 at 0 and 1, alternated AB_PAIRS times (default twice; one
  # machine, one run: METHOD.md), sections $2<0|1>_<run> of $OUT/engine_$2.json
  for i in $(seq ${AB_PAIRS:-2}); do
    for v in 0 1; do
      env $1=$v timeout ${T_AB:-280} python3 bench/engine_gpu.py ${ENGINE_ARGS:---quick --no-breakdown --speed-kv-gib 40} \
        --section $2${v}_$i --out $OUT/engine_$2.json > $OUT/engine_$2${v}_$i.log 2>&1
      rc=$?; echo "== $1=$v, run $i (exit $rc)"; grep -E "decode |% of roofline|^(bf16|fp8|nvfp4|triax)" $OUT/engine_$2${v}_$i.log
      [ "$rc" = 0 ] || { echo "gpu_run.sh: error: engine_gpu.py failed with $1=$v (exit $rc, log in $OUT/engine_$2${v}_$i.log)" >&2; status=1; }
    done
  done
}
if has pdl; then engine_ab KVSERVING_PDL pdl; fi  # programmatic dependent launch off and on
if has merge; then engine_ab KVSERVING_FUSED_MERGE merge; fi  # the decode's split merge: its own launch or in the kernel
if has gemv; then  # bf16 weights at 1-16 tokens: cuBLAS against the Triton GEMV and block GEMM, per projection, then in the engine
  timeout ${T_GEMM:-240} python3 bench/fp8_gemm_gpu.py --tokens 1,2,8,16 --tiles 16x64w4s4k4 --gemv g8x2048w4s1k1 \
    --bf16-tiles 64w4s4k2,128w8s4k2 --out $OUT/fp8_gemm_gpu.json > $OUT/gemm.log 2>&1
  rc=$?; sed -n '/^us per call/,$p' $OUT/gemm.log | grep -E "^M = |bf16 weights|one layer|^\| (qkv|o|gate_up|down) \| [0-9]+ \| [0-9.]+ us"
  [ "$rc" = 0 ] || { echo "gpu_run.sh: error: fp8_gemm_gpu.py failed (exit $rc, log in $OUT/gemm.log)" >&2; status=1; }
  engine_ab KVSERVING_BF16_GEMV gemv
fi
if has layout; then  # the KV layouts: READs of the same pages, then the engine bench alternated (one machine, one run)
  for lay in layer_major page_major; do
    timeout ${T_NIXL:-240} python3 bench/nixl_read_gpu.py --kv-layout $lay --out $OUT/nixl_read_$lay.json > $OUT/nixl_read_$lay.log 2>&1
    rc=$?; echo "== READ, kv_cache.layout $lay (exit $rc)"; grep -E " regions " $OUT/nixl_read_$lay.log
    [ "$rc" = 0 ] || { echo "gpu_run.sh: error: nixl_read_gpu.py failed with --kv-layout $lay (exit $rc, log in $OUT/nixl_read_$lay.log)" >&2; status=1; }
  done
  for i in 1 2; do
    for lay in layer_major page_major; do
      timeout ${T_LAYOUT:-240} python3 bench/engine_gpu.py ${LAYOUT_ARGS:---quick --no-breakdown --speed-kv-gib 40 --formats nvfp4,triaxial} \
        --kv-layout $lay --section ${lay}_$i --out $OUT/engine_layout.json > $OUT/engine_${lay}_$i.log 2>&1
      rc=$?; echo "== engine, kv_cache.layout $lay, run $i (exit $rc)"; grep -E "decode |% of roofline|^(bf16|fp8|nvfp4|triax)" $OUT/engine_${lay}_$i.log
      [ "$rc" = 0 ] || { echo "gpu_run.sh: error: engine_gpu.py failed with --kv-layout $lay (exit $rc, log in $OUT/engine_${lay}_$i.log)" >&2; status=1; }
    done
  done
fi
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats ${NCU_METRICS:+--metrics $NCU_METRICS}"
ncu_summary() {  # the lines of an ncu report that say what binds
  grep -vE "^\s*-+\s*$|^\s*$" "$1" | grep -E "regs|launch|_decode_kernel|_gl_extend|refill|Duration|Throughput|Occupancy|Registers|Issue|Ipc|Bank|Pipe|pipe_|stalled|Eligible|Warp Cycles|Block Limit|Hit Rate|Busy|Shared Memory|Stall|Executed Instructions" | cut -c1-140
}
if has ncu; then  # profile one decode launch per format named in "$@" (after 3 warm-up launches of each)
  (cd bench && timeout 400 ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip $((3 * $#)) --launch-count $# \
    $NCU_SECTIONS python3 profile_decode.py "$@") > $OUT/ncu.txt 2>&1 || { echo "gpu_run.sh: error: ncu failed (see $OUT/ncu.txt)" >&2; status=1; }
  ncu_summary $OUT/ncu.txt
fi
if has ncux; then  # profile each extend launch of profile_extend.py (ours and FlashInfer's)
  [ -n "$warm" ] && { wait $warm; warm=""; }
  (cd bench && timeout 400 ncu --clock-control none --kernel-name "regex:_gl_extend|refill" $NCU_SECTIONS \
    python3 profile_extend.py ${NCUX_ARGS:-nvfp4 tri fi}) > $OUT/ncux.txt 2>&1 || { echo "gpu_run.sh: error: ncu failed (see $OUT/ncux.txt)" >&2; status=1; }
  ncu_summary $OUT/ncux.txt
fi
exit $status
