#!/bin/bash
# Run through the device tool on the H200 (one call does everything):
#   run(command="bash experiments/run_e2e_device.sh", carry=[".whl"], timeout_s=300)
# Writes under $OUT: gpu_e2e.json/.log (Pallas vs reference tokens, MTP == plain greedy,
# MTP speedup at batch 1).  ml_collections travels as a wheel in .whl/.
OUT=${OUT:-/tmp/gpu_e2e_out}
source experiments/device_env.sh
timeout "${BENCH_TIMEOUT:-250}" python3 -m experiments.gpu_e2e --config=configs/gpu_e2e.py \
  --config.out_dir="$OUT" 2>&1 | tee "$OUT/gpu_e2e.log"
echo "exit: $?"
