#!/bin/bash
# Run through the device tool on the H200 (one call does everything):
#   run(command="bash experiments/run_kernel_device.sh", carry=[".whl"], timeout_s=300)
# Writes under $OUT: kernel_bench.json/.png/.log, env.txt.  ml_collections is not
# in the device image: it travels as a wheel in .whl/ (see .library/device/README.md).
OUT=${OUT:-/tmp/kernel_bench_out}
source experiments/device_env.sh
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
  python3 -c "import jax, jaxlib, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__); print(jax.devices())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "${BENCH_TIMEOUT:-250}" python3 -m experiments.kernel_bench \
  --config=configs/kernel_bench.py --config.out_dir="$OUT" 2>&1 | tee "$OUT/kernel_bench.log"
echo "exit: $?"
