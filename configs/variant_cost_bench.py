# python -m experiments.variant_cost_bench --config=configs/variant_cost_bench.py
"""What an attention variant costs against the hand-written path it replaces (issue 49):
the window512 variant vs the model config's sliding_window = 512, and window512's and
sinks4-window1020's decode step at 8k context vs 1k, full attention beside them, on the
default model (its positions extended past 2,048).

get_config("runlocal"): short contexts, one round (a smoke test of the launcher).
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = "default"  # load_checkpoint's name
  config.contexts = (1024, 8192)  # decode steps timed at these prompt lengths
  config.window = 512
  config.sinks = 4  # sinks + sinks_window: the "streaming" alias's 4 + 1020
  config.sinks_window = 1020
  config.prefill_tokens = 2048  # one prompt's chunks, timed per chunk
  config.chunk = 256  # max_num_batched_tokens: the prefill chunk
  config.num_scheduler_steps = 1  # one decode step per device call
  config.repeats = 9  # interleaved rounds after one untimed (compiling) call each
  config.inner = 10  # steps per sample (one step varies +-50% on a shared machine)
  config.seed = 0
  config.out_dir = "results"
  config.name = "variant_cost_bench"
  if arg == "runlocal":
    config.contexts = (256, 1024)
    config.window = 128
    config.sinks_window = 124
    config.prefill_tokens = 512
    config.chunk = 128
    config.repeats = 1
    config.name = "variant_cost_bench_runlocal"  # never overwrite the committed results
  return config
