# python -m experiments.ngram_bench --config=configs/ngram_bench.py
"""n-gram (prompt lookup) speculation on the real model (issue 27 item 3).

SmolLM2-135M-Instruct (float32 weights dequantized from its GGUF) through warm
Engines, greedy, chat prompts through the model's template: plain decoding vs
speculative="ngram" at a fixed K and with num_draft="auto", at batch 1 and 4, on
a workload where prompt lookup should pay (repeat a given paragraph) and one
where it should not (an open-ended story).  `get_config("runlocal")` shrinks it
to a smoke run and writes results/ngram_bench_runlocal.*.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = "smollm2-135m-instruct"
  config.batches = (1, 4)
  config.max_new_tokens = 96
  config.repeats = 3  # interleaved timed rounds after an untimed (compiling) one
  config.num_draft = 4  # the fixed-K variant's K
  config.ngram_n = 3
  config.max_model_len = 512
  config.workloads = ("repeat", "story")
  config.goal_pays = 1.3  # issue 27: ngram >= 1.3x plain where it should pay
  config.goal_auto = 0.97  # num_draft="auto" never below 0.97x plain
  config.out_dir = "results"
  config.name = "ngram_bench"
  if arg == "runlocal":
    config.batches = (1,)
    config.max_new_tokens = 16
    config.repeats = 1
    config.name = "ngram_bench_runlocal"
  return config
