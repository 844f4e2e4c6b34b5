# python -m experiments.hybrid_bench --config=configs/hybrid_bench.py
"""Hybrid linear-attention models (issue 15; claims C4, C8) on the CPU.

(1) multi-turn chats on a tiny random-init Qwen3.5-like hybrid through the
    Engine: 16-token pages + state snapshots, the grown-block design (pages as
    big as one recurrent state), and no prefix cache,
(2) one Gated DeltaNet layer of qwen3.5-9b's shape: chunked vs token-by-token
    prefill,
(3) qwen3.5-9b's snapshot bytes in the allocated pool.
`get_config("runlocal")` shrinks (1) and (2) to a smoke run and writes
results/hybrid_bench_runlocal.*, never the committed results.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.repeats = 3  # (1): median of interleaved timed runs per variant
  # (1) the tiny hybrid: (3 linear + 1 full) x groups, Qwen3.5's state / KV proportions
  # (a state per request as big as ~66 tokens of KV here, 1,572 there).
  config.groups = 2
  config.hidden_size = 64
  config.num_heads = 4
  config.num_kv_heads = 1
  config.head_dim = 32
  config.linear_num_key_heads = 2
  config.linear_num_value_heads = 4
  config.linear_head_dim = 16
  config.linear_chunk_size = 16
  config.page_size = 16
  config.max_num_seqs = 4
  config.max_num_batched_tokens = 256
  config.chat_num_chats = 4
  config.chat_num_turns = 4
  config.chat_user_len = 48
  config.chat_output_len = 16
  config.shared_prefix_lens = (30, 40)  # probes: two requests sharing this many tokens
  config.seed_preset = "qwen3.5-9b"
  # (2) one Gated DeltaNet layer at the preset's dims, batch 1, zero entering state.
  config.prefill_lens = (256, 1024)
  config.prefill_repeats = 7  # a few ms to a few hundred per call
  config.prefill_tolerance = 1e-3  # max |chunked - recurrent| of the outputs
  # (3) the engine's default snapshot bound: 8 per running request.
  config.snapshot_max_num_seqs = 8
  config.snapshots_per_request = 8
  config.out_dir = "results"
  config.name = "hybrid_bench"
  if arg == "runlocal":
    config.repeats = 1
    config.chat_num_chats = 2
    config.chat_num_turns = 3
    config.chat_user_len = 32
    config.chat_output_len = 8
    config.prefill_lens = (64, 128)
    config.prefill_repeats = 1
    config.name = "hybrid_bench_runlocal"
  return config
