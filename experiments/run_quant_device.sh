#!/bin/bash
# Run through the device tool on the H200 (one call does everything):
#   run(command="bash experiments/run_quant_device.sh", carry=[".whl"], timeout_s=480)
# Writes under $OUT: quant_bench_gpu.json/.png/.log.  ml_collections travels as a
# wheel in .whl/ (as for experiments/run_kernel_device.sh).
OUT=${OUT:-/tmp/quant_bench_out}
source experiments/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout "${BENCH_TIMEOUT:-420}" python3 -m experiments.quant_bench \
  --config=configs/quant_bench.py:gpu --config.out_dir="$OUT" 2>&1 | tee "$OUT/quant_bench.log"
echo "exit: $?"
