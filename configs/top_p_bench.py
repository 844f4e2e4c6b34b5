# python -m experiments.top_p_bench --config=configs/top_p_bench.py
"""The top-k / top-p filter on real models' next-token distributions (issue 50, item 4: a
262,144-token vocabulary must not make sampling a large sort per row): how often a row's
sets lie among its TOP_CANDIDATES largest logits, and the filter's time with the
candidates against the whole-row sort, beside a greedy decode step of the same batch.

get_config("runlocal"): the tiny random preset, one short round (a smoke test of the launcher).
"""
import ml_collections

TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
        "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "The history of the city begins with a small fishing village on the river, where "
        "traders from the north came each summer to exchange furs, salt and iron tools. "
        "Over two centuries the market grew into a town with a stone bridge, a cathedral "
        "and a university whose library still holds the oldest maps of the region.")


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoints = ("smollm2-135m-instruct", "gemma3-270m")  # load_checkpoint's names
  config.text = TEXT  # its next-token distributions, one per position
  # (temperature, top_k, top_p): what clients commonly send; top_k 0 = off.
  config.settings = ((0.7, 0, 0.9), (1.0, 0, 0.9), (1.0, 0, 0.95), (1.0, 40, 1.0),
                     (1.3, 0, 0.95))
  config.batch = 8  # rows a decode step filters together
  config.decode_setting = (1.0, 0, 0.9)  # the Engine's sampled decode against greedy
  config.new_tokens = 24  # per request and round
  config.decode_rounds = 3
  config.repeats = 5  # interleaved rounds after one untimed (compiling) call each
  config.out_dir = "results"
  config.name = "top_p_bench"
  if arg == "runlocal":
    config.checkpoints = ("tiny",)
    config.settings = ((1.0, 0, 0.9),)
    config.repeats = 1
    config.new_tokens = 4
    config.decode_rounds = 1
    config.name = "top_p_bench_runlocal"  # never overwrite the committed results
  return config
