r"""Trains (or resumes) a byte-level code LM with MTP heads; exports the default model.

  python -m experiments.train --config=configs/tiny_code.py --workdir runs/tiny_code

Every `checkpoint_every` steps the whole TrainState goes to <workdir>/ckpt (orbax);
rerunning the same command resumes from the latest one and continues the exact
loss curve (batches are a pure function of (seed, step)).  At the end, with
`export_dir` set, the launcher measures held-out bits per byte and MTP greedy
acceptance and writes the model, MODEL_CARD.md and model_card.json there.
"""
from __future__ import annotations

import dataclasses
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

from kvjax import api
from kvjax.model.config import ModelConfig
from kvjax.model.params import count_params
from kvjax.model.presets import get_preset
from kvjax.text.tokenizer import ByteTokenizer
from kvjax.training import code_corpus, code_eval
from kvjax.training import corpus as corpus_lib
from kvjax.training import train as train_lib
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


@dataclasses.dataclass(frozen=True)
class TrainingData:
  train: np.ndarray  # int32 [n]: the training token stream
  evals: dict  # eval set name -> int32 [n] token stream; the first is the periodic eval's
  heldout_texts: list  # [(name, bytes)] of the held-out files: the signature prompts
  summary: dict  # the card's corpus record
  description: str  # one line for the card


def load_data(config) -> TrainingData:
  """config.corpus 'code' (manifest + pack, kvjax/training/code_corpus.py) or 'stdlib'."""
  if config.corpus == "code":
    manifest = code_corpus.load_manifest(config.corpus_manifest)
    pack = os.path.expanduser(config.corpus_pack)
    if not os.path.exists(pack):
      raise FileNotFoundError(
          f"corpus pack {pack} not found: build it with `python -m experiments.build_corpus "
          "--config=configs/build_corpus.py` (fetches the pinned wheels once)")
    splits = manifest["splits"]
    return TrainingData(
        train=code_corpus.split_tokens(manifest, pack, "train"),
        evals={s: code_corpus.split_tokens(manifest, pack, s) for s in ("heldout", "unseen")},
        heldout_texts=code_corpus.split_texts(manifest, pack, "heldout"),
        summary=code_corpus.summary(manifest),
        description=(f"the stdlib plus {len(manifest['packages']) - 1} pinned PyPI packages, "
                     f"deduplicated; held out: {', '.join(splits['heldout']['packages'])} "
                     f"(packages), unseen: {', '.join(splits['unseen']['packages'])} (a "
                     "package no training package contains)"))
  if config.corpus == "stdlib":
    corpus = corpus_lib.load_corpus(config.corpus_root, config.heldout_fraction,
                                    max_files=config.max_corpus_files)
    heldout = corpus.split_files("heldout")
    with_root = lambda f: os.path.join(corpus.root, f.path)
    return TrainingData(
        train=corpus_lib.split_tokens(corpus, "train"),
        evals={"heldout": corpus_lib.split_tokens(corpus, "heldout")},
        heldout_texts=[(f.path, open(with_root(f), "rb").read()) for f in heldout],
        summary=corpus.summary(),
        description="the interpreter's standard library, files held out by path hash")
  raise ValueError(f"config.corpus must be 'code' or 'stdlib', got {config.corpus!r}")


def initial_state(config, cfg: ModelConfig, optimizer) -> train_lib.TrainState:
  """Fresh TrainState: random params, or config.init_from's (continued training)."""
  state = train_lib.init_train_state(cfg, jax.random.PRNGKey(config.seed), optimizer)
  if not config.init_from:
    return state
  init_cfg, params = checkpoint.restore(config.init_from)
  if init_cfg != cfg:
    raise ValueError(f"init_from {config.init_from} holds a {init_cfg.name!r} model that "
                     f"differs from the config's {cfg.name!r}")
  return state.replace(params=params, opt_state=optimizer.init(params))


def train_and_evaluate(config, workdir: str) -> list:
  """Runs (or resumes) training; returns this call's per-log-step metrics."""
  cfg = model_config(config)
  data = load_data(config)
  periodic_set = next(iter(data.evals))
  eval_windows = corpus_lib.heldout_slice(data.evals[periodic_set], config.seq_len,
                                          config.eval_windows)
  logging.info("corpus %s: %d train tokens; eval %s", config.corpus, len(data.train),
               ", ".join(f"{k} {len(v)}" for k, v in data.evals.items()))

  optimizer = train_lib.make_optimizer(
      config.learning_rate, config.warmup_steps, config.total_steps,
      config.end_lr_fraction, config.weight_decay, config.grad_clip)
  train_step = train_lib.make_train_step(cfg, optimizer, config.mtp_weight)
  state = initial_state(config, cfg, optimizer)
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
    batch = corpus_lib.sample_batch(data.train, config.seed, step, config.batch_size,
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
        record[f"{periodic_set}_bits_per_byte"] = train_lib.bits_per_byte(state.params, cfg,
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
          f"{periodic_set} {record[f'{periodic_set}_bits_per_byte']:.4f} bits/byte "
          if f"{periodic_set}_bits_per_byte" in record else "", rate, seconds / 60, eta / 60)
      t_log, step_log = time.time(), step
    if step % config.checkpoint_every == 0 or done:
      checkpoint.save_train_state(manager, step, state, dict(
          progress, train_seconds=progress["train_seconds"] + segment["seconds"]))
  metrics_file.close()
  progress["train_seconds"] += segment["seconds"]
  if config.export_dir:
    export(config, workdir, cfg, data, state.params, progress, step)
  return history


def evaluate_set(config, cfg: ModelConfig, params, tokens: np.ndarray) -> tuple:
  """One eval set -> (card record, its fixed slice {windows, prompts} for the export)."""
  big = corpus_lib.heldout_slice(tokens, config.seq_len, config.final_eval_windows)
  prompts = corpus_lib.heldout_slice(tokens, config.acceptance_prompt_len - 1,
                                     config.acceptance_prompts)
  fixed = corpus_lib.heldout_slice(tokens, config.seq_len, config.slice_windows)
  fixed_prompts = corpus_lib.heldout_slice(tokens, config.acceptance_prompt_len - 1,
                                           config.slice_prompts)
  record = {
      "bits_per_byte": train_lib.bits_per_byte(params, cfg, big),
      "windows": config.final_eval_windows,
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
              params, cfg, fixed_prompts, config.acceptance_new_tokens)}}
  return record, {"windows": fixed, "prompts": fixed_prompts}


def evaluate_signatures(config, cfg: ModelConfig, params, texts: list) -> dict:
  """Greedy continuations of held-out function headers: how many parse (kvjax/training/code_eval.py)."""
  signatures = code_eval.function_signatures(texts, config.signatures,
                                              config.signature_max_chars)
  tokenizer = ByteTokenizer()
  result = api.generate(api.Model(cfg, params, tokenizer=tokenizer),
                        [tokenizer.encode(s, add_special_tokens=True) for s in signatures],
                        config.signature_new_tokens)
  parsed = []
  for signature, tokens in zip(signatures, result.tokens):
    finished = bool(tokens) and tokens[-1] == tokenizer.eos_id
    parsed.append(code_eval.completion_parses(signature, tokenizer.decode(tokens), finished))
  return {"new_tokens": config.signature_new_tokens, "signatures": signatures,
          "parsed": parsed, "num_parsed": sum(parsed)}


def export(config, workdir: str, cfg: ModelConfig, data: TrainingData, params,
           progress: dict, step: int) -> None:
  """Measures the final model and writes it with its card to config.export_dir.

  The export also holds eval_slices.npz, the fixed windows and prompts of every
  eval set, so tests/test_default_model.py re-checks the card without the corpus.
  """
  logging.info("final evaluation of step %d", step)
  params = jax.tree_util.tree_map(lambda x: x.astype(config.export_dtype), params)
  evals, slices = {}, {}
  for name, tokens in data.evals.items():
    evals[name], fixed = evaluate_set(config, cfg, params, tokens)
    slices.update({f"{name}_{k}": v for k, v in fixed.items()})
    logging.info("%s: %.4f bits/byte, MTP mean accepted length %.3f", name,
                 evals[name]["bits_per_byte"],
                 evals[name]["mtp_acceptance"]["mean_accepted_length"])
  signatures = evaluate_signatures(config, cfg, params, data.heldout_texts)
  logging.info("held-out signatures: %d of %d parse", signatures["num_parsed"],
               len(signatures["parsed"]))
  training = {
      "steps": step, "tokens": step * config.batch_size * config.seq_len,
      "batch_size": config.batch_size, "seq_len": config.seq_len,
      "learning_rate": config.learning_rate, "warmup_steps": config.warmup_steps,
      "total_steps": config.total_steps, "mtp_weight": config.mtp_weight,
      "train_seconds": progress["train_seconds"], "segments": progress["segments"]}
  if config.init_from:  # the stage this run continued, as that model's card recorded it
    init_card = checkpoint.read_metadata(config.init_from)
    training["init_from"] = {k: init_card[k] for k in ("name", "corpus", "training")}
  card = {
      "name": cfg.name,
      "description": "Byte-level Python code LM (Llama-style GQA decoder) with "
                     f"{cfg.mtp_num_hidden_layers} DeepSeek-V3-style MTP draft modules, "
                     f"trained on {data.description}.",
      "launch": (f"python -m experiments.train --config=configs/tiny_code.py "
                 f"--workdir {workdir}"),
      "params": count_params(params),
      "params_without_mtp": count_params(params.replace(mtp=())),
      "dtype": str(jax.tree_util.tree_leaves(params)[0].dtype),
      "corpus": data.summary,
      "training": training,
      "eval": {"hardware": hardware(), "sets": evals, "signatures": signatures},
  }
  out = config.export_dir
  checkpoint.save(out, cfg, params, metadata=card)
  with open(os.path.join(out, "model_card.json"), "w") as f:
    json.dump(card, f, indent=2)
  np.savez(os.path.join(out, "eval_slices.npz"), **slices)
  with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
    f.write(model_card_markdown(cfg, card))
  logging.info("exported %s", out)


def _corpus_line(corpus: dict) -> str:
  if "python_version" in corpus:  # kvjax.training.corpus's summary: the stdlib alone
    return (f"Python {corpus['python_version']} stdlib: {corpus['num_files']} files, "
            f"{corpus['num_bytes']:,} bytes; held out by path hash: {corpus['heldout_files']} "
            f"files, {corpus['heldout_bytes']:,} bytes")
  splits, packages = corpus["splits"], corpus["packages"]
  named = lambda split: ", ".join(f"{n} {packages[n]['version']}"
                                  for n in splits[split]["packages"])
  return (f"train: {named('train')} ({splits['train']['files']:,} files, "
          f"{splits['train']['bytes']:,} bytes); held-out packages: {named('heldout')} "
          f"({splits['heldout']['bytes']:,} bytes); unseen: {named('unseen')} "
          f"({splits['unseen']['bytes']:,} bytes); dedup removed {corpus['dedup']['exact']} "
          f"exact and {corpus['dedup']['near']} near copies "
          "(kvjax/assets/code_corpus_manifest.json, sha256 "
          f"{corpus['manifest_sha256'][:16]}...)")


def _training_line(t: dict) -> str:
  hardware = "; ".join(sorted({s["hardware"] for s in t["segments"]}))
  line = (f"{t['steps']:,} steps x {t['batch_size']} x {t['seq_len']} = {t['tokens']:,} "
          f"tokens in {t['train_seconds'] / 60:.1f} min on {hardware}")
  if "init_from" in t:  # stage 1 first, on its own corpus
    init = t["init_from"]
    line = (f"{_training_line(init['training'])} on {_corpus_line(init['corpus'])}; then "
            f"{line} on the corpus above")
  return line


def model_card_markdown(cfg: ModelConfig, card: dict) -> str:
  e = card["eval"]
  fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)
  rows = [
      ("architecture",
       f"{cfg.num_layers} layers, D={cfg.hidden_size}, F={cfg.intermediate_size}, "
       f"{cfg.num_heads} q / {cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab "
       f"{cfg.vocab_size} (bytes + BOS/EOS/PAD), {cfg.mtp_num_hidden_layers} MTP modules"),
      ("params", f"{card['params']:,} ({card['params_without_mtp']:,} without MTP), "
                 f"{card['dtype']}"),
      ("corpus", _corpus_line(card["corpus"])),
      ("training", _training_line(card["training"])),
      ("evaluated on", e["hardware"]),
  ]
  for name, s in e["sets"].items():
    acc = s["mtp_acceptance"]
    rows += [
        (f"{name}: bits/byte", f"**{s['bits_per_byte']:.4f}** ({s['windows']} windows of "
                               f"{card['training']['seq_len']}+1 bytes)"),
        (f"{name}: MTP greedy acceptance",
         f"per draft position {fmt(acc['per_position'])} (per head {fmt(acc['per_head'])}); "
         f"mean accepted length **{acc['mean_accepted_length']:.3f}** of "
         f"{acc['num_drafts'] + 1}")]
  sig = e["signatures"]
  rows.append(("held-out function signatures",
               f"**{sig['num_parsed']} of {len(sig['parsed'])}** greedy continuations "
               f"({sig['new_tokens']} bytes) parse"))
  acc = next(iter(e["sets"].values()))["mtp_acceptance"]
  notes = [
      f"Acceptance: the trunk greedily continues {acc['prompts']} prompts of "
      f"{acc['prompt_len']} bytes by {acc['new_tokens']} bytes; a draft is accepted iff it "
      "equals the trunk's greedy token and every earlier draft of its step was accepted "
      "(kvjax/training/train.py). Signatures: headers of top-level functions of the held-out files; "
      "a continuation is cut at its last complete line, or where the body ends, and must "
      "parse with ast (kvjax/training/code_eval.py). tests/test_default_model.py recomputes "
      "bits/byte and acceptance on the fixed slices in eval_slices.npz and the signatures.",
      "Load: `kvjax.weights.checkpoint.restore()` (this directory is its default). "
      f"Reproduce or continue: `{card['launch']}` (resumes from the latest checkpoint in "
      "the workdir; configs/tiny_code.py says how to make its starting point).",
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
