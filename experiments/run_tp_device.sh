#!/bin/bash
# Tensor-parallel decode steps on real GPUs (issue 14); useful only when the machine
# has 2 or more accelerators (one GPU: the script records that and times nothing):
#   run(command="bash experiments/run_tp_device.sh", carry=[".whl"], timeout_s=400)
# Writes under $OUT: tp_collectives.json/.png/.log, env.txt.
OUT=${OUT:-/tmp/tp_collectives_out}
source experiments/device_env.sh
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "${BENCH_TIMEOUT:-350}" python3 -m experiments.tp_collectives \
  --config=configs/tp_collectives.py --config.out_dir="$OUT" 2>&1 | tee "$OUT/tp_collectives.log"
echo "exit: $?"
