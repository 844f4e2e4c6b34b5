#!/bin/bash
# Run through the device tool on a GPU (one call does everything; prepared, not yet run):
#   run(command="bash experiments/run_moe_device.sh", carry=[".whl"], timeout_s=420)
# Writes under $OUT: moe_bench_gpu.json, moe_bench.log, env.txt.  The device image has
# neither ml_collections nor tokamax (the "gpu" extra, kvjax/moe/grouped_matmul.py): both
# travel as wheels in .whl/, fetched here first with
#   pip download --no-deps -d .whl tokamax==0.0.12 einshape immutabledict jaxtyping \
#     qwix tensorboardX typeguard==2.13.3 wadler_lindig
# (tokamax's own dependencies that jax and flax do not already bring).
OUT=${OUT:-/tmp/moe_bench_out}
source experiments/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/tokamax-*.whl .whl/einshape-*.whl .whl/immutabledict-*.whl \
  .whl/jaxtyping-*.whl .whl/qwix-*.whl .whl/tensorboard[xX]-*.whl .whl/typeguard-*.whl \
  .whl/wadler_lindig-*.whl || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, tokamax; print('jax', jax.__version__, jax.devices()); print(tokamax.__file__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# The grouped section times "xla" (jax.lax.ragged_dot) against "tokamax" (Mosaic GPU, else
# Triton) at 4096 tokens and checks they agree; the decode sections run as on the CPU.
timeout "${BENCH_TIMEOUT:-360}" python3 -m experiments.moe_bench \
  --config=configs/moe_bench.py:gpu --config.out_dir="$OUT" 2>&1 | tee "$OUT/moe_bench.log"
echo "exit: $?"
