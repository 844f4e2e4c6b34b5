# python -m experiments.serve_bench --config=configs/serve_bench.py
"""Serving benchmark (claims C9-C10, C14, C15) on the default model and the CPU.

(a) engine vs HF transformers static batching on random-prompt workloads of
    fixed and of varied lengths, at two concurrencies,
(b) TTFT per turn with and without the prefix cache on 10-turn chats (C15),
(c) tokens/s and acceptance with and without MTP speculation (K = 2, and
    num_draft="auto": the adaptive draft policy) at batch 1, 8 and 32.
`get_config("grown")` runs (c) alone, at batch 1 and 8, on the default model grown to
123M parameters with the same logits (kvjax/weights/grow.py), so a step reads a
larger model's weights: results/serve_bench_grown.*.
`get_config("runlocal")` shrinks every part so the script runs end to end in
a couple of minutes (its numbers then mean little) and writes
results/serve_bench_runlocal.*, never the committed results.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = ""  # "" = the built-in default model (tiny-code)
  config.seed = 0
  config.parts = ("a", "b", "c")
  # Grow the model before serving it (kvjax.weights.grow.grow's sizes; None: as loaded).
  config.grow = ml_collections.config_dict.placeholder(dict)
  config.page_size = 16
  config.max_num_batched_tokens = 512
  # (a) throughput: same requests (EOS off), engine max_num_seqs = HF batch; fixed
  # lengths, then lengths uniform within +-hf_range_ratio of the means.
  config.hf_num_requests = 32
  config.hf_batches = (8, 32)
  config.hf_input_len = 128
  config.hf_output_len = 64
  config.hf_range_ratio = 0.75
  # The engine's token budget in (a): 32 prompts of 128 prefill in 2-3 steps, as HF's
  # one static batch does in one (vLLM's offline default budget is larger still).
  config.hf_max_num_batched_tokens = 2048
  # (b) chats: each turn adds a user message and the model's answer to the history.
  config.chat_num_chats = 4
  config.chat_num_turns = 10
  config.chat_user_len = 64
  config.chat_output_len = 32
  # (c) MTP: random prompts, K = 2 drafts and the adaptive policy (num_draft "auto").
  config.spec_batches = (1, 8, 32)
  config.spec_requests_per_slot = 2
  config.spec_input_len = 64
  config.spec_output_len = 128
  config.num_draft = 2
  config.num_scheduler_steps = 16  # decode steps per device call (multi-step scheduling)
  # Decode-bound: a smaller budget keeps the block tables' padding slack small.
  config.spec_max_num_batched_tokens = 128
  config.repeats = 3  # median of interleaved timed runs per variant
  # (c)'s batch-1 runs last ~0.1 s each on this CPU: more repeats for a stable median.
  config.spec_repeats = 9
  config.out_dir = "results"
  config.name = "serve_bench"
  if arg == "grown":
    config.parts = ("c",)
    config.grow = dict(hidden_size=1024, intermediate_size=2816, num_kv_heads=8,
                       num_layers=8)
    config.spec_batches = (1, 8)
    config.spec_repeats = 5  # a run decodes 256 (batch 1) or 2,048 tokens of a 123M model
    config.name = "serve_bench_grown"
  if arg == "runlocal":
    config.repeats = 1
    config.spec_repeats = 1
    config.hf_num_requests = 4
    config.hf_batches = (2, 4)
    config.hf_input_len = 32
    config.hf_output_len = 8
    config.chat_num_chats = 2
    config.chat_num_turns = 3
    config.chat_user_len = 32
    config.chat_output_len = 8
    config.spec_batches = (1, 2)
    config.spec_requests_per_slot = 1
    config.spec_input_len = 32
    config.spec_output_len = 16
    config.name = "serve_bench_runlocal"
  return config
