#!/bin/bash
# Issue 18's next default model on a lent GPU (one call, < 10 minutes):
#   run(command="bash experiments/run_train_device.sh", carry=[".whl", ".corpus"],
#       timeout_s=600)
# .whl/ holds the ml_collections wheel, .corpus/ the code corpus pack
# (cp ~/.cache/kvjax/corpus/code_corpus.zip .corpus/): the device has no registry.
# Trains configs/tiny_code.py:gpu from scratch and writes the model, its card and
# eval slices to $OUT/model, the log to $OUT/train.log; review the card before
# copying the model over kvjax/assets/default_model.
OUT=${OUT:-/tmp/train_out}
source experiments/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout "${TRAIN_TIMEOUT:-560}" python3 -m experiments.train --config=configs/tiny_code.py:gpu \
  --workdir "$OUT/run" --config.export_dir="$OUT/model" \
  --config.corpus_pack=.corpus/code_corpus.zip "$@" 2>&1 | grep -v "/orbax/" | tee "$OUT/train.log"
echo "exit: $?"
rm -rf "$OUT/run/ckpt"  # the TrainState (optimizer moments) does not come back
