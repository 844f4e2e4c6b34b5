#!/bin/bash
# Run through the device tool on the H200 (one call does everything, < 8 minutes):
#   run(command="bash experiments/run_gpu_scale_device.sh", carry=[".whl"], timeout_s=540)
# Writes under $OUT: gpu_scale.json/.png/.log (the JSON is rewritten after every
# section, so a timeout keeps what finished).  ml_collections travels as a wheel in .whl/.
OUT=${OUT:-/tmp/gpu_scale_out}
source experiments/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout "${BENCH_TIMEOUT:-470}" python3 -m experiments.gpu_scale --config=configs/gpu_scale.py \
  --config.out_dir="$OUT" 2>&1 | tee "$OUT/gpu_scale.log"
echo "exit: $?"
