# python -m experiments.sampling_options_bench --config=configs/sampling_options_bench.py
"""What a sampling option costs in the one step program that serves them all (issue 32,
start-up): top-p filtering and logprobs asked by every row against none, on decode and
prefill shapes of the default model and SmolLM2-135M-Instruct.

get_config("runlocal"): the tiny random preset, one short round (a smoke test of the launcher).
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoints = ("default", "smollm2-135m-instruct")  # load_checkpoint's names
  config.max_model_len = 2048  # the server's default context
  config.top_p = 0.9  # what "asked" rows ask for, with logprobs and temperature 1
  config.repeats = 5  # interleaved rounds after one untimed (compiling) call each
  config.out_dir = "results"
  config.name = "sampling_options_bench"
  if arg == "runlocal":
    config.checkpoints = ("tiny",)
    config.max_model_len = 256
    config.repeats = 1
    config.name = "sampling_options_bench_runlocal"  # never overwrite the committed results
  return config
