# python -m experiments.train --config=configs/tiny_code.py --workdir=runs/tiny_code
r"""Trains kvjax's built-in default model: byte-level Python LM with 2 MTP heads, two stages.

Stage 1, `:stdlib` (from scratch on the interpreter's stdlib; 6,000 steps, 49M tokens,
about 1 minute on one H200 at 1.26M tokens/s; two CPU cores give ~3k tokens/s, i.e.
hours), exported to runs/tiny_code_stdlib/model:
  python -m experiments.train --config=configs/tiny_code.py:stdlib \
      --workdir runs/tiny_code_stdlib

Stage 2, the default (continues stage 1's weights on the code corpus: the stdlib plus
pinned PyPI packages, deduplicated, whole packages held out; kvjax/training/code_corpus.py.
Build the pack once with experiments/build_corpus.py), exported as the shipped model
with its card and evaluation slices to kvjax/assets/default_model:
  nohup python -m experiments.train --config=configs/tiny_code.py \
      --workdir runs/tiny_code > runs/train.log 2>&1 &
Rerunning a command resumes from the latest checkpoint in its workdir, so a CPU run
can be split across sessions (max_train_seconds / stop_at_step).

`:gpu` (issue 18's next model, for a lent GPU: experiments/run_train_device.sh): a
16.5M-parameter model from scratch on the code corpus, ~65M tokens in about 6 minutes
of an H200 (estimated from stage 1's 1.26M tokens/s and 5.7x the FLOPs per token),
exported in bfloat16 (33 MB) to <workdir>/model for review before it replaces the
shipped one.

Smoke run (seconds; stdlib files, so it runs on any machine):
  python -m experiments.train --config=configs/tiny_code.py:runlocal \
      --workdir /tmp/tiny_code_smoke
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.preset = "tiny-code"  # kvjax.model.presets.PRESETS entry
  config.model_overrides = ml_collections.ConfigDict()  # ModelConfig fields to replace
  config.seed = 0

  config.batch_size = 16
  config.seq_len = 512
  config.total_steps = 1300
  config.learning_rate = 1e-3
  config.warmup_steps = 100
  config.end_lr_fraction = 0.1
  config.weight_decay = 0.1
  config.grad_clip = 1.0
  config.mtp_weight = 0.5  # per MTP module, added to the trunk's LM loss

  # Continued training: a kvjax checkpoint of the same ModelConfig to start from
  # (ignored once the workdir has a checkpoint of its own).
  config.init_from = "runs/tiny_code_stdlib/model"
  config.corpus = "code"  # 'code': manifest + pack below; 'stdlib': corpus_root's .py files
  config.corpus_manifest = "kvjax/assets/code_corpus_manifest.json"
  config.corpus_pack = "~/.cache/kvjax/corpus/code_corpus.zip"
  config.corpus_root = ml_collections.config_dict.placeholder(str)  # None: this stdlib
  config.heldout_fraction = 0.05  # 'stdlib' only; the code corpus splits by package
  config.max_corpus_files = ml_collections.config_dict.placeholder(int)  # None: all files
  config.log_every = 50
  config.eval_every = 500
  config.eval_windows = 64  # periodic held-out eval: windows of seq_len + 1
  config.checkpoint_every = 500
  # Stop early (checkpointed; exported if export_dir is set) after this many
  # cumulative training seconds, or at this step: splits a run across sessions.
  config.max_train_seconds = ml_collections.config_dict.placeholder(float)
  config.stop_at_step = ml_collections.config_dict.placeholder(int)

  # End of training: the shipped model, its card and the numbers on it.
  config.export_dir = ml_collections.config_dict.placeholder(str)
  config.export_dir = "kvjax/assets/default_model"
  config.export_dtype = "float32"  # what the export stores and is evaluated in
  config.final_eval_windows = 512  # launcher's held-out bits/byte
  config.acceptance_prompts = 32  # held-out prompts greedily continued for MTP acceptance
  config.acceptance_prompt_len = 64
  config.acceptance_new_tokens = 96
  # The fixed held-out slice tests/test_default_model.py recomputes: bits/byte on
  # slice_windows windows of seq_len + 1, MTP acceptance on slice_prompts prompts.
  config.slice_windows = 16
  config.slice_prompts = 4
  # Greedy continuations of held-out top-level function signatures, cut at their last
  # complete line (or where the body ends), must parse (kvjax/training/code_eval.py).
  config.signatures = 20
  config.signature_new_tokens = 256
  config.signature_max_chars = 200  # longer headers are not used as prompts

  if arg in ("stdlib", "runlocal"):  # stage 1: from scratch on the stdlib
    config.init_from = None
    config.corpus = "stdlib"
    config.total_steps = 6000
    config.learning_rate = 3e-3
    config.warmup_steps = 300
    config.export_dir = "runs/tiny_code_stdlib/model"

  if arg == "gpu":
    config.init_from = None
    config.model_overrides = ml_collections.ConfigDict(dict(
        name="code-16m", hidden_size=384, intermediate_size=1024, num_layers=8,
        num_heads=6, num_kv_heads=2))
    config.batch_size = 32
    config.total_steps = 4000
    config.learning_rate = 2e-3
    config.warmup_steps = 200
    config.max_train_seconds = 420.0  # export even if the device is slower than estimated
    config.checkpoint_every = 1000
    config.export_dir = None  # the device script names it (under $OUT)
    config.export_dtype = "bfloat16"

  if arg == "runlocal":
    config.model_overrides = ml_collections.ConfigDict(dict(
        name="tiny-code-smoke", hidden_size=64, intermediate_size=128, num_layers=1,
        num_heads=2, num_kv_heads=1, max_position_embeddings=64))
    config.batch_size = 4
    config.seq_len = 32
    config.total_steps = 30
    config.warmup_steps = 5
    config.learning_rate = 3e-3
    config.max_corpus_files = 40
    config.heldout_fraction = 0.25
    config.log_every = 5
    config.eval_every = 15
    config.eval_windows = 4
    config.checkpoint_every = 10
    config.export_dir = None
    config.final_eval_windows = 4  # shapes shared with the periodic eval: one compile
    config.acceptance_prompts = 2
    config.acceptance_prompt_len = 8
    config.acceptance_new_tokens = 8
    config.slice_windows = 4
    config.slice_prompts = 2
    config.signatures = 2
    config.signature_new_tokens = 16
    config.signature_max_chars = 40  # the smoke model's context is 64
  return config
