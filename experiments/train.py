r"""Trains (or resumes) a byte-level code LM with MTP heads; exports the default model.

  python -m experiments.train --config=configs/tiny_code.py --workdir runs/tiny_code

Every `checkpoint_every` steps the whole TrainState goes to <workdir>/ckpt (orbax);
rerunning the same command resumes from the latest one and continues the exact
loss curve (batches are a pure function of (seed, step)).  At the end, with
`export_dir` set, the launcher measures held-out bits per byte and MTP greedy
acceptance and writes the model, MODEL_CARD.md and model_card.json there.
"""
from __future__ import annotations

import json
import logging as std_logging
import os
import platform
import textwrap
import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from kvjax import corpus as corpus_lib
from kvjax import train as train_lib
from kvjax.config import ModelConfig, get_preset
from kvjax.params import count_params
from kvjax.weights import checkpoint

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/tiny_code",
                               "Checkpoints and metrics.jsonl of this run.")


def model_config(config) -> ModelConfig:
  return get_preset(config.preset).replace(**config.model_overrides.to_dict())


def hardware() -> str:
  device = jax.devices()[0]
  return (f"{jax.device_count()}x {device.device_kind} ({device.platform}), "
          f"{os.cpu_count()} host cores, {platform.machine()}")


def train_and_evaluate(config, workdir: str) -> list:
  """Runs (or resumes) training; returns this call's per-log-step metrics."""
  cfg = model_config(config)
  corpus = corpus_lib.load_corpus(config.corpus_root, config.heldout_fraction,
                                  max_files=config.max_corpus_files)
  train_tokens = corpus_lib.split_tokens(corpus, "train")
  heldout_tokens = corpus_lib.split_tokens(corpus, "heldout")
  eval_windows = corpus_lib.heldout_slice(heldout_tokens, config.seq_len, config.eval_windows)
  logging.info("corpus %s: %d train / %d held-out tokens", corpus.root, len(train_tokens),
               len(heldout_tokens))

  optimizer = train_lib.make_optimizer(
      config.learning_rate, config.warmup_steps, config.total_steps,
      config.end_lr_fraction, config.weight_decay, config.grad_clip)
  train_step = train_lib.make_train_step(cfg, optimizer, config.mtp_weight)
  state = train_lib.init_train_state(cfg, jax.random.PRNGKey(config.seed), optimizer)
  manager = checkpoint.train_state_manager(os.path.join(workdir, "ckpt"))
  state, progress = checkpoint.restore_train_state(manager, state)
  progress = progress or {"train_seconds": 0.0, "segments": []}
  step = int(state.step)
  logging.info("%s: %d params; %s at step %d", cfg.name, count_params(state.params),
               "resumed" if step else "starting", step)

  last_step = min(config.total_steps, config.stop_at_step or config.total_steps)
  tokens_per_step = config.batch_size * config.seq_len
  segment = {"hardware": hardware(), "first_step": step, "last_step": step, "seconds": 0.0}
  if step < last_step:
    progress["segments"].append(segment)
  history = []
  os.makedirs(workdir, exist_ok=True)
  metrics_file = open(os.path.join(workdir, "metrics.jsonl"), "a")
  t_segment = t_log = time.time()
  step_log = step
  out_of_time = False
  while step < last_step and not out_of_time:
    batch = corpus_lib.sample_batch(train_tokens, config.seed, step, config.batch_size,
                                    config.seq_len)
    state, metrics = train_step(state, batch)
    step += 1
    segment["seconds"] = time.time() - t_segment
    segment["last_step"] = step
    seconds = progress["train_seconds"] + segment["seconds"]
    out_of_time = config.max_train_seconds is not None and seconds >= config.max_train_seconds
    done = step == last_step or out_of_time
    if step % config.log_every == 0 or done:
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      now = time.time()
      rate = (step - step_log) * tokens_per_step / (now - t_log)
      eta = (config.total_steps - step) * tokens_per_step / rate
      record = dict(step=step, tokens=step * tokens_per_step, train_seconds=seconds,
                    tokens_per_second=rate, **metrics)
      if step % config.eval_every == 0 or done:
        record["heldout_bits_per_byte"] = train_lib.bits_per_byte(state.params, cfg,
                                                                  eval_windows)
      history.append(record)
      metrics_file.write(json.dumps(record) + "\n")
      metrics_file.flush()
      logging.info(
          "step %d/%d loss %.4f lm %.4f (%.3f bits/byte) %s%s| %.0f tok/s, %.1f min, "
          "ETA %.1f min", step, config.total_steps, metrics["loss"], metrics["lm_loss"],
          metrics["lm_loss"] / np.log(2),
          "".join(f"mtp{k} {metrics[f'mtp{k}_loss']:.3f} "
                  for k in range(1, cfg.mtp_num_hidden_layers + 1)),
          f"held-out {record['heldout_bits_per_byte']:.4f} bits/byte "
          if "heldout_bits_per_byte" in record else "", rate, seconds / 60, eta / 60)
      t_log, step_log = time.time(), step
    if step % config.checkpoint_every == 0 or done:
      checkpoint.save_train_state(manager, step, state, dict(
          progress, train_seconds=progress["train_seconds"] + segment["seconds"]))
  metrics_file.close()
  progress["train_seconds"] += segment["seconds"]
  if config.export_dir:
    export(config, workdir, cfg, corpus, heldout_tokens, state.params, progress, step)
  return history


def export(config, workdir: str, cfg: ModelConfig, corpus, heldout_tokens, params,
           progress: dict, step: int) -> None:
  """Measures the final model and writes it with its card to config.export_dir."""
  logging.info("final evaluation of step %d", step)
  big = corpus_lib.heldout_slice(heldout_tokens, config.seq_len, config.final_eval_windows)
  prompts = corpus_lib.heldout_slice(heldout_tokens, config.acceptance_prompt_len - 1,
                                     config.acceptance_prompts)
  fixed = corpus_lib.heldout_slice(heldout_tokens, config.seq_len, config.slice_windows)
  fixed_prompts = corpus_lib.heldout_slice(heldout_tokens, config.acceptance_prompt_len - 1,
                                           config.slice_prompts)
  card = {
      "name": cfg.name,
      "description": "Byte-level Python code LM (Llama-style GQA decoder) with "
                     f"{cfg.mtp_num_hidden_layers} DeepSeek-V3-style MTP draft modules, "
                     "trained from scratch on the interpreter's standard library.",
      "launch": (f"python -m experiments.train --config=configs/tiny_code.py "
                 f"--workdir {workdir}"),
      "params": count_params(params),
      "params_without_mtp": count_params(params.replace(mtp=())),
      "dtype": str(jax.tree_util.tree_leaves(params)[0].dtype),
      "corpus": corpus.summary(),
      "training": {
          "steps": step, "tokens": step * config.batch_size * config.seq_len,
          "batch_size": config.batch_size, "seq_len": config.seq_len,
          "learning_rate": config.learning_rate, "warmup_steps": config.warmup_steps,
          "total_steps": config.total_steps, "mtp_weight": config.mtp_weight,
          "train_seconds": progress["train_seconds"], "segments": progress["segments"]},
      "eval": {
          "hardware": hardware(),
          "heldout_bits_per_byte": train_lib.bits_per_byte(params, cfg, big),
          "heldout_windows": config.final_eval_windows,
          "mtp_acceptance": dict(
              train_lib.mtp_acceptance(params, cfg, prompts, config.acceptance_new_tokens),
              prompts=config.acceptance_prompts, prompt_len=config.acceptance_prompt_len,
              new_tokens=config.acceptance_new_tokens),
          "slice": {
              "seq_len": config.seq_len, "windows": config.slice_windows,
              "sha256": corpus_lib.tokens_sha256(fixed),
              "bits_per_byte": train_lib.bits_per_byte(params, cfg, fixed),
              "prompts": config.slice_prompts,
              "prompts_sha256": corpus_lib.tokens_sha256(fixed_prompts),
              "mtp_acceptance": train_lib.mtp_acceptance(
                  params, cfg, fixed_prompts, config.acceptance_new_tokens)}},
  }
  logging.info("model card: %s", json.dumps(card["eval"], indent=1))
  out = config.export_dir
  checkpoint.save(out, cfg, params, metadata=card)
  with open(os.path.join(out, "model_card.json"), "w") as f:
    json.dump(card, f, indent=2)
  with open(os.path.join(out, "corpus_files.json"), "w") as f:
    json.dump([{"path": s.path, "sha256": s.sha256, "bytes": s.num_bytes,
                "split": "heldout" if s.heldout else "train"} for s in corpus.files], f,
              indent=0)
  with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
    f.write(model_card_markdown(cfg, card))
  logging.info("exported %s", out)


def model_card_markdown(cfg: ModelConfig, card: dict) -> str:
  c, t, e = card["corpus"], card["training"], card["eval"]
  acc = e["mtp_acceptance"]
  fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)
  rows = [
      ("architecture",
       f"{cfg.num_layers} layers, D={cfg.hidden_size}, F={cfg.intermediate_size}, "
       f"{cfg.num_heads} q / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab "
       f"{cfg.vocab_size} (bytes + BOS/EOS/PAD), {cfg.mtp_num_hidden_layers} MTP modules"),
      ("params", f"{card['params']:,} ({card['params_without_mtp']:,} without MTP), "
                 f"{card['dtype']}"),
      ("corpus",
       f"Python {c['python_version']} stdlib: {c['num_files']} files, {c['num_bytes']:,} "
       f"bytes; held out by path hash: {c['heldout_files']} files, {c['heldout_bytes']:,} "
       f"bytes (corpus_files.json, listing sha256 {c['listing_sha256'][:16]}...)"),
      ("training",
       f"{t['steps']:,} steps x {t['batch_size']} x {t['seq_len']} = {t['tokens']:,} tokens "
       f"in {t['train_seconds'] / 60:.1f} min on "
       + "; ".join(sorted({s["hardware"] for s in t["segments"]}))),
      ("evaluated on", e["hardware"]),
      ("held-out bits/byte", f"**{e['heldout_bits_per_byte']:.4f}** "
                             f"({e['heldout_windows']} windows of {t['seq_len']}+1 bytes)"),
      ("MTP greedy acceptance",
       f"per draft position {fmt(acc['per_position'])} (per head {fmt(acc['per_head'])}); "
       f"mean accepted length **{acc['mean_accepted_length']:.3f}** of "
       f"{acc['num_drafts'] + 1}"),
  ]
  notes = [
      f"Acceptance: the trunk greedily continues {acc['prompts']} held-out prompts of "
      f"{acc['prompt_len']} bytes by {acc['new_tokens']} bytes; a draft is accepted iff it "
      "equals the trunk's greedy token and every earlier draft of its step was accepted "
      "(kvjax/train.py). tests/test_default_model.py recomputes bits/byte "
      f"({e['slice']['bits_per_byte']:.4f}) and acceptance on a fixed "
      f"{e['slice']['windows']}-window held-out slice.",
      "Load: `kvjax.weights.checkpoint.restore()` (this directory is its default). "
      f"Reproduce or continue: `{card['launch']}` (resumes from the latest checkpoint in "
      "the workdir).",
  ]
  return "\n\n".join([
      f"# {card['name']}: kvjax's built-in default model", textwrap.fill(card["description"]),
      "| | |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows),
      *(textwrap.fill(n) for n in notes)]) + "\n"


def _quiet_orbax(record) -> bool:
  """Drops orbax's per-save INFO chatter so progress lines stay readable."""
  return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  std_logging.getLogger("absl").addFilter(_quiet_orbax)
  train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
