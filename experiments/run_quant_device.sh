#!/bin/bash
# Run through the device tool on the H200 (one call does everything):
#   run(command="bash experiments/run_quant_device.sh", carry=[".whl"], timeout_s=480)
# Writes under $OUT: quant_bench_gpu.json/.png/.log.  ml_collections travels as a
# wheel in .whl/ (as for experiments/run_kernel_device.sh).
set -o pipefail
OUT=${OUT:-/tmp/quant_bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/ml_collections-*.whl || exit 1
export PYTHONPATH=/tmp/site:.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout "${BENCH_TIMEOUT:-420}" python3 -m experiments.quant_bench \
  --config=configs/quant_bench.py:gpu --config.out_dir="$OUT" 2>&1 | tee "$OUT/quant_bench.log"
echo "exit: $?"
