# python -m experiments.serve_http --config=configs/serve_http.py
"""HTTP serving on the CPU (issue 13): a request-rate sweep through the bench
client against a local server, and the serving overhead at saturation
(HTTP output tokens/s over the same requests offline through a warm Engine).
`get_config("runlocal")` shrinks it to a smoke run (results/serve_http_runlocal.*).
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = ""  # "" = the built-in default model (tiny-code)
  config.seed = 0
  config.num_prompts = 32
  config.input_len = 128
  config.output_len = 64
  config.max_num_seqs = 8
  config.max_num_batched_tokens = 512
  config.request_rates = (2.0, 8.0, 32.0)  # req/s, Poisson; saturation (inf) is always run
  config.goodput_ttft_ms = 500.0
  config.goodput_tpot_ms = 50.0
  config.warmup = 3  # untimed rounds per variant (compiles)
  config.repeats = 5  # interleaved rounds of (HTTP at saturation, offline), median reported
  config.max_tries = 6  # calls of a round (or sweep point) while it compiles a step program
  config.out_dir = "results"
  config.name = "serve_http"
  if arg == "runlocal":
    config.num_prompts = 8
    config.input_len = 32
    config.output_len = 16
    config.request_rates = (8.0,)
    config.repeats = 1
    config.warmup = 2
    config.name = "serve_http_runlocal"
  return config
