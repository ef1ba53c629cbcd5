#!/usr/bin/env bash
# One device call: install, GPU tests, then the benchmarks named in $@ (logs under $OUT).
set -uo pipefail
export PYTHONUNBUFFERED=1 EJLABEL_CACHE_DIR=/tmp/ejlabel-cache
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
for step in "$@"; do
  case "$step" in
    # The GPU tests take about 11 minutes, more than one device command may: two steps.
    gputests) timeout 420 python3 -m pytest -q -m gpu tests --ignore=tests/test_attention_mosaic.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 40 ;;
    mosaicgpu) timeout 540 python3 -m pytest -q -m gpu tests/test_attention_mosaic.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_mosaic_gpu_all.log" | tail -n 25 ;;
    labeltests) timeout 300 python3 -m pytest -q tests/test_labels.py tests/test_graph.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_labels_gpu.log" | tail -n 15 ;;
    kernelsquick) timeout 420 python3 bench/bench_kernels.py --quick --out "$OUT/kernels_quick.md" 2>&1 | tee "$OUT/kernels_quick.log" | tail -n 40 ;;
    kernels) timeout 560 python3 bench/bench_kernels.py --out "$OUT/kernels.md" 2>&1 | tee "$OUT/kernels.log" | tail -n 50 ;;
    attention|matmul|norms|cross_entropy) timeout 570 python3 bench/bench_kernels.py --only "$step" --out "$OUT/kernels_$step.md" 2>&1 | tee "$OUT/kernels_$step.log" | grep -v "^W1\|Delay kernel" | tail -n 60 ;;
    attntests) timeout 300 python3 -m pytest -q tests/test_kernels_attention.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_attention_gpu.log" | tail -n 15 ;;
    sweep) timeout 420 python3 bench/sweep_attention.py 2>&1 | tee "$OUT/sweep_attention.log" | tail -n 8 ;;
    attnbench) timeout 540 python3 bench/bench_attention.py --only a,b,c --samples 7 2>&1 | tee "$OUT/attention.log" | grep "^| [abc]" | tail -n 70 ;;
    attnb) timeout 300 python3 bench/bench_attention.py --only b --samples 7 2>&1 | tee "$OUT/attention_b.log" | grep -v "^W1\|Delay kernel" | tail -n 30 ;;
    attnd) timeout 240 python3 bench/bench_attention.py --only d --samples 7 2>&1 | tee "$OUT/attention_d.log" | grep -v "^W1\|Delay kernel" | tail -n 14 ;;
    attne) timeout 420 python3 bench/bench_attention.py --only e --samples 7 2>&1 | tee "$OUT/attention_e.log" | grep -v "^W1\|Delay kernel" | tail -n 52 ;;
    attnodd) timeout 200 python3 bench/bench_attention.py --only e --match "odd length" --samples 7 2>&1 | tee "$OUT/attention_odd.log" | grep "^| e" | tail -n 8 ;;
    attncheck) timeout 120 python3 bench/bench_attention.py --only check --quick 2>&1 | tee "$OUT/attention_check.log" | tail -n 30 ;;
    attngpu) timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_attention.py tests/test_attention_mosaic.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_attention_gpu.log" | tail -n 25 ;;
    registers) timeout 300 python3 bench/probe_registers.py 2>&1 | tee "$OUT/registers.log" | tail -n 40 ;;
    quickmosaic) timeout 200 python3 bench/quick_mosaic.py 2>&1 | tee "$OUT/quick_mosaic.log" | grep -v "^W1\|Delay kernel" | tail -n 30 ;;
    profile) timeout 240 python3 bench/profile_mosaic.py 2>&1 | tee "$OUT/profile_mosaic.log" | grep -v "^W1\|Delay kernel" | tail -n 40 ;;
    compileprobe) timeout 300 python3 bench/probe_compile.py 2>&1 | tee "$OUT/probe_compile.log" | grep -v "^W1\|Delay kernel" | tail -n 12 ;;
    compilediff) timeout 200 python3 bench/probe_compile.py --diff 2>&1 | tee "$OUT/probe_compile_diff.log" | grep -v "^W1\|Delay kernel" | tail -n 40 ;;
    probelse) timeout 60 python3 bench/probe_lse.py 2>&1 | tee "$OUT/probe_lse.log" | tail -n 5 ;;
    probefused) timeout 300 python3 bench/probe_fused_backward.py 2>&1 | tee "$OUT/probe_fused.log" | grep -v "^W1\|Delay kernel" | tail -n 20 ;;
    probeplan) timeout 200 python3 bench/probe_mosaic_plan.py 2>&1 | tee "$OUT/mosaic_plan.log" | grep -v "^W1\|Delay kernel" | tail -n 24 ;;
    kerneltimes) (cd bench && timeout 300 python3 probe_kernel_times.py --model --out "$OUT/kernel_times.md" 2>&1 | tee "$OUT/kernel_times.log" | grep -v "^W1\|Delay kernel" | tail -n 170) ;;
    attntimes) (cd bench && timeout 240 python3 probe_kernel_times.py --out "$OUT/attention_kernel_times.md" 2>&1 | tee "$OUT/attention_kernel_times.log" | grep -v "^W1\|Delay kernel" | tail -n 20) ;;
    losstimes) (cd bench && timeout 200 python3 probe_kernel_times.py --loss --out "$OUT/loss_kernel_times.md" 2>&1 | tee "$OUT/loss_kernel_times.log" | grep -v "^W1\|Delay kernel" | tail -n 110) ;;
    staging) (cd bench && timeout 300 python3 probe_forward_staging.py 2>&1 | tee "$OUT/forward_staging.log" | grep -v "^W1\|Delay kernel" | tail -n 20) ;;
    mosaiccosts) timeout 150 python3 bench/probe_mosaic_costs.py 2>&1 | tee "$OUT/mosaic_costs.log" | grep -v "^W1\|Delay kernel" | tail -n 14 ;;
    modelfused) timeout 240 python3 bench/bench_model.py --samples 10 --tune-budget 0 --out "$OUT/model_fused.md" 2>&1 | tee "$OUT/model_fused.log" | tail -n 14 ;;
    modellce) timeout 560 python3 bench/bench_model.py --samples 6 --max-configs 4 --tune-budget 400 --out "$OUT/model_lce.md" 2>&1 | tee "$OUT/model_lce.log" | tail -n 25 ;;
    mosaictests) timeout 240 python3 -m pytest -q -m gpu tests/test_attention_mosaic.py::test_gpu_flash_attention_mosaic tests/test_attention_mosaic.py::test_gpu_head_dim_256_forward tests/test_attention_mosaic.py::test_gpu_values_and_gradients tests/test_attention_mosaic.py::test_gpu_other_tiles -p no:cacheprovider 2>&1 | tee "$OUT/pytest_mosaic_gpu.log" | tail -n 25 ;;
    mosaicgrads) timeout 450 python3 -m pytest -q -m gpu tests/test_attention_mosaic.py::test_gpu_values_and_gradients tests/test_attention_mosaic.py::test_gpu_forward_pingpong tests/test_attention_mosaic.py::test_gpu_fused_backward tests/test_attention_mosaic.py::test_gpu_other_tiles -p no:cacheprovider 2>&1 | tee "$OUT/pytest_mosaic_grads_gpu.log" | tail -n 25 ;;
    fusedtests) timeout 150 python3 -m pytest -q -m gpu tests/test_attention_mosaic.py::test_gpu_fused_backward -p no:cacheprovider 2>&1 | tee "$OUT/pytest_fused_gpu.log" | tail -n 15 ;;
    tritongpu) timeout 420 python3 -m pytest -q -m gpu tests/test_kernels_attention.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_triton_gpu.log" | tail -n 25 ;;
    lcetests) timeout 300 python3 -m pytest -q tests/test_kernels_linear_cross_entropy.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_lce_gpu.log" | tail -n 15 ;;
    lcepasses)  # the loss's passes over the logits: the kernel beside its variants (bench/RESULTS.md, runs 62-68)
      args=()
      for v in previous_kernel normalised label_shift; do
        patch -s -o "/tmp/lce_$v.py" kernels/linear_cross_entropy.py < "bench/runs/2026-11-26_lce_$v.diff" || exit 1
        args+=(--variant "${v//_/ }=/tmp/lce_$v.py")
      done
      (cd bench && timeout 300 python3 probe_lce_passes.py "${args[@]}" --samples 9 --out "$OUT/lce_passes.md" 2>&1 | tee "$OUT/lce_passes.log" | tail -n 14) ;;
    lce) timeout 300 python3 bench/bench_linear_cross_entropy.py --samples 9 --chunks 8192 --out "$OUT/lce.md" 2>&1 | tee "$OUT/lce.log" | tail -n 14 ;;
    logitsgemm) timeout 400 python3 bench/probe_logits_gemm.py 2>&1 | grep -v "^W1\|Delay kernel" | tee "$OUT/logits_gemm.log" | tail -n 25 ;;
    rows) timeout 200 python3 bench/probe_softmax_rows.py 2>&1 | tee "$OUT/softmax_rows.log" | grep -v "^W1\|Delay kernel" | tail -n 16 ;;
    schedules) MOSAIC_GPU_DUMP_PTXAS=1 timeout 540 python3 bench/probe_schedules.py 2>&1 | tee "$OUT/schedules.log" | grep "^|\|^###\|=== variant\|stack frame" | tail -n 60 ;;
    schedules256) MOSAIC_GPU_DUMP_PTXAS=1 timeout 540 python3 bench/probe_schedules.py --dim256 2>&1 | tee "$OUT/schedules256.log" | grep "^|\|^###\|=== variant\|stack frame" | tail -n 40 ;;
    overlap)  # the forward overlap patch, not kept (bench/RESULTS.md, runs 54-56), timed and checked, then taken out again
      git apply bench/runs/2026-11-26_forward_overlap.diff || exit 1
      MOSAIC_GPU_DUMP_PTXAS=1 timeout 300 python3 bench/probe_schedules.py 2>&1 | tee "$OUT/overlap_schedules.log" | grep "^|\|^###\|stack frame" | tail -n 60
      timeout 240 python3 -m pytest -q -m gpu tests/test_attention_mosaic.py::test_gpu_forward_pingpong tests/test_attention_mosaic.py::test_gpu_values_and_gradients -p no:cacheprovider 2>&1 | tee "$OUT/overlap_pytest.log" | tail -n 8
      git apply -R bench/runs/2026-11-26_forward_overlap.diff ;;
    ranked)  # segment ids as ranks (bench/RESULTS.md, run 153, not kept): the mask alone in a kernel, the test that failed, the probe; the patch stays applied for the steps after it (the device runs a copy)
      git apply bench/runs/2026-11-26_run153_ranked_segment_mask.diff || exit 1
      timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_mosaic.py -k ranked_mask 2>&1 | tee "$OUT/ranked_mask_test.log" | grep -v "^W1" | tail -n 30
      timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider "tests/test_attention_mosaic.py::test_gpu_values_and_gradients[bfloat16-128-513-4-2-options3]" 2>&1 | tee "$OUT/ranked_failed_test.log" | grep -v "^W1" | tail -n 30
      (cd bench && timeout 160 python3 probe_segment_step.py 2>&1 | tee "$OUT/ranked_probe.log" | grep "^|\|^###\|difference\|per step") ;;
    modelpacked) timeout 585 python3 bench/bench_model.py --packed --samples 6 --tune-budget 280 --out "$OUT/model_packed.md" 2>&1 | tee "$OUT/model_packed.log" | tail -n 25 ;;
    model) timeout 560 python3 bench/bench_model.py --out "$OUT/model.md" 2>&1 | tee "$OUT/model.log" | tail -n 40 ;;
    modelquick) timeout 400 python3 bench/bench_model.py --quick --out "$OUT/model_quick.md" 2>&1 | tee "$OUT/model_quick.log" | tail -n 40 ;;
  esac
done
