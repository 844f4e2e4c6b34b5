# python -m experiments.serve_diagnose --config=configs/serve_diagnose.py
"""Diagnosing a slow server by symptom (C18) under three load patterns, and C15's TTFT cut.

chat_no_cache  growing multi-turn histories, prefix cache off  (expected: prefill)
chat_cache     the same chats, prefix cache on                 (expected: healthy)
small_pool     random prompts, a KV pool that holds a few of the offered requests
               (expected: concurrency)
"Slow" is relative to the unloaded server: targets are ttft_factor and
tpot_factor times the baseline's mean TTFT and TPOT (chat_num_chats
single-turn requests of chat_user_len ids, one at a time).  `get_config("runlocal")`
shrinks everything for a smoke run (under a minute on an idle 2-core CPU) and
writes results/serve_diagnose_runlocal.*, never the committed results.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = ""  # "" = the built-in default model (tiny-code)
  config.seed = 0
  config.page_size = 16
  config.max_num_batched_tokens = 512
  # chats: each turn sends the history (earlier turns and answers) plus a new message.
  config.chat_num_chats = 4
  config.chat_num_turns = 10
  config.chat_user_len = 128
  config.chat_output_len = 16
  config.chat_request_rate = 2.0  # chats starting per second (Poisson)
  # One request at a time: a turn's first token then waits for its own prefill only.
  config.chat_max_concurrency = 1
  # small_pool: more requests in flight than the pool's pages hold.
  config.pool_num_requests = 24
  config.pool_input_len = 256
  config.pool_output_len = 32
  config.pool_max_num_seqs = 8
  config.pool_max_concurrency = 8
  config.pool_request_rate = float("inf")  # all at once, up to pool_max_concurrency
  config.pool_requests_held = 2  # the pool holds this many requests' pages at once
  # targets: multiples of the unloaded baseline's means ("4x the idle service is slow").
  config.ttft_factor = 4.0
  config.tpot_factor = 4.0
  config.metrics_interval_s = 0.25
  config.warmup_passes = 2  # untimed passes of each pattern with other content
  config.repeats = 3  # interleaved rounds; each pattern reports its median one
  config.out_dir = "results"
  config.name = "serve_diagnose"
  if arg == "runlocal":
    config.chat_num_chats = 2
    config.chat_num_turns = 3
    config.chat_user_len = 32
    config.chat_output_len = 8
    config.pool_num_requests = 4
    config.pool_input_len = 32
    config.pool_output_len = 8
    config.pool_max_num_seqs = 2
    config.pool_max_concurrency = 2
    config.pool_requests_held = 1
    config.metrics_interval_s = 0.05
    config.warmup_passes = 1
    config.repeats = 1
    config.name = "serve_diagnose_runlocal"
  return config
