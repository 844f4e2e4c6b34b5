# python -m experiments.gpu_e2e --config=configs/gpu_e2e.py
"""End-to-end device check: the default model through the compiled Pallas kernel.

Greedy tokens of the reference backend, the Pallas backend and both with MTP
speculation, on held prompts; tokens/s are medians of `repeats` runs after a
warm-up.  On the device: experiments/run_e2e_device.sh.
`get_config("runlocal")` runs the Pallas kernel in interpret mode on the CPU
with 2 prompts and 8 new tokens (timings then mean nothing; it proves the
script end to end).
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.new_tokens = 128  # tokens generated per prompt
  config.num_prompts = 8  # of experiments/gpu_e2e.py's PROMPTS (at most 8)
  config.pallas_backend = "pallas"  # the compiled kernel; "pallas_interpret" on the CPU
  config.repeats = 3  # timed runs after one warm-up; the median is reported
  config.out_dir = "results"
  config.name = "gpu_e2e"
  if arg == "runlocal":
    config.new_tokens = 8
    config.num_prompts = 2
    config.pallas_backend = "pallas_interpret"
    config.repeats = 1
    config.name = "gpu_e2e_runlocal"  # never overwrite the committed results.
  return config
