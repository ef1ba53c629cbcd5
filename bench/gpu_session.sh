#!/usr/bin/env bash
# One device call on a GPU machine: install, then the steps named in $@, in order: the GPU test
# grid and the benchmarks whose figures bench/RESULTS.md shows, each with the options of its
# current figures. Logs go under $OUT; the benchmarks write their rows to bench/results/, which
# is copied to $OUT/results after each step (commit those files to replace the figures).
#   OUT=DIR bash bench/gpu_session.sh gputests mosaicgpu
#   OUT=DIR bash bench/gpu_session.sh attention_abc attention_d model
#   OUT=DIR bash bench/gpu_session.sh modelsharded modelshardedpacked     (a host of 2 or 4 GPUs)
#   OUT=DIR bash bench/gpu_session.sh raygpus rayscaling                  (a 4-GPU host, Ray installed)
set -uo pipefail
started=$(mktemp)  # results written after this are this call's own
export PYTHONUNBUFFERED=1 EJLABEL_CACHE_DIR=/tmp/ejlabel-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log to $OUT/NAME.log, show the tail
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^W1\|Delay kernel" | tail -n 60
  # After each step, so that a call cut short still brings back the steps it finished.
  mkdir -p "$OUT/results" && find bench/results -name "*.json" -newer "$started" -exec cp {} "$OUT/results/" \;
}

for name in "$@"; do
  case "$name" in
    # The GPU tests take about 11 minutes, more than one device command may: two steps.
    gputests) step pytest_gpu 420 python3 -m pytest -q -m gpu tests --ignore=tests/test_attention_mosaic.py -p no:cacheprovider ;;
    mosaicgpu) step pytest_mosaic_gpu 540 python3 -m pytest -q -m gpu tests/test_attention_mosaic.py -p no:cacheprovider ;;
    kernels_matmul|kernels_attention|kernels_norms|kernels_cross_entropy) step "$name" 570 python3 bench/bench_kernels.py --only "${name#kernels_}" ;;
    attention_abc) step attention_abc 240 python3 bench/bench_attention.py --only a,b,c --samples 7 ;;
    attention_c) step attention_c 240 python3 bench/bench_attention.py --only c --samples 7 ;;
    attention_f) step attention_f 300 python3 bench/bench_attention.py --only f --samples 7 ;;
    attention_g) step attention_g 300 python3 bench/bench_attention.py --only g --samples 7 ;;
    attention_h) step attention_h 300 python3 bench/bench_attention.py --only h --samples 7 ;;
    attention_i) step attention_i 400 python3 bench/bench_attention.py --only i --samples 7 ;;
    attention_d) step attention_d 240 python3 bench/bench_attention.py --only d --samples 7 ;;
    attention_e) step attention_e 420 python3 bench/bench_attention.py --only e --samples 7 ;;
    # Each backward kernel alone, the whole backward and cuDNN's backward alone.
    backward) step backward 400 python3 bench/bench_backward.py --samples 9 ;;
    # The Mosaic kernels' deal of items by load against the snake, packed, 1 and 4 layers.
    workorder) step work_order 400 python3 bench/bench_work_order.py --samples 9 ;;
    attention_check) step attention_check 300 python3 bench/bench_attention.py --only check --quick ;;
    # ptxas's spills and warnings for every Mosaic attention kernel (a diagnostic: no results file).
    ptxas) step ptxas 400 python3 bench/ptxas_report.py --dims 64,128,256 --segments ;;
    lce) step lce 300 python3 bench/bench_linear_cross_entropy.py --samples 9 --chunks 8192 ;;
    # The larger vocabularies of Llama 3 (128k) and Gemma (256k).
    lce128k|lce256k) step "$name" 400 python3 bench/bench_linear_cross_entropy.py --samples 7 --vocab "$((${name//[!0-9]/} * 1024))" --chunks 8192 --token-chunks 1024,4096 ;;
    model) step model 560 python3 bench/bench_model.py --samples 6 --max-configs 4 --tune-budget 400 ;;
    modelpacked) step model_packed 585 python3 bench/bench_model.py --packed --samples 6 --tune-budget 280 ;;
    rayscaling) step ray_scaling 560 python3 bench/bench_ray_tuning.py --scaling --workers 1,2,4,8 --seq-lens 16,32,48 --no-local ;;
    rayoverhead) step ray_overhead 580 python3 bench/bench_ray_tuning.py --overhead ;;
    # On a host of 2 or 4 GPUs (nvidia-h100-x2 / -x4): the sharded model, data parallel, over them all.
    modelsharded) step model_sharded 300 python3 bench/bench_model.py --devices "$(nvidia-smi -L | wc -l)" --train-only --samples 6 --tune-budget 0 --skip-second-call ;;
    modelshardedpacked) step model_sharded_packed 300 python3 bench/bench_model.py --devices "$(nvidia-smi -L | wc -l)" --packed --train-only --samples 6 --tune-budget 0 --skip-second-call ;;
    raygpus) step ray_gpus 560 env JAX_PLATFORMS=cpu python3 bench/bench_ray_tuning.py --gpus 1,2,4 --overhead --calls-per-task auto,1 --max-configs 4 --iters 3 ;;
    *) echo "unknown step: $name" >&2; exit 2 ;;
  esac
done
exit 0
