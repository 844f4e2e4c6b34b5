"""Issue 49 (attention variants, the cost goals): a variant against the path it replaces.

Two goals on the CPU reference path, the default model (its positions extended past
its 2,048 so a request runs to 8k; RoPE has no table to outgrow):
- a variant's step costs <= 1.05x the hand-written path it replaces: the window512
  variant against the model config's sliding_window = 512, an Engine decode step at
  each context and a prefill chunk, greedy tokens checked equal.  Since the model's window
  became that variant too (kvjax/attention/variants.py layer_variant), both runs trace one
  program: the row checks that nothing else differs (results/variant_cost_bench.json is
  the last run against the hand-written path).  sinks4-window1020's
  hand-written path, the "streaming" KV layout class, is gone ("streaming" now names
  the variant); its last comparison is results/variant_cost_bench_streaming_layout.json;
- window512's and sinks4-window1020's decode step at 8k context <= 1.2x its cost at 1k
  (pages released and skipped; the sinks' block read, the middle not), full
  attention's beside them growing with the context.
Each run is an Engine holding one request whose prompt is the context; a decode
sample is one `Engine.step` (one token; num_scheduler_steps 1), a prefill sample one
prompt's chunks (per chunk).  Every run in interleaved rounds, medians.  Writes
results/<name>.json and .png; says which CPU ran it and its load (the machine is shared).
"""
import functools
import json
import os
import time

from absl import app
from ml_collections import config_flags
import numpy as np

from experiments import common
import kvjax
from kvjax.attention.variants import sinks_window, sliding_window

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/variant_cost_bench.py", "experiment config", lock_config=True)

COST_GOAL, GROWTH_GOAL = 1.05, 1.2  # variant / hand-written; window decode 8k / 1k
# What each run is (model config's window or attention variant) by kind.
KINDS = ("full", "window", "hand-window", "sinks")
PAIRS = (("window", "hand-window"),)  # (variant, hand-written)
GROWTH = (("window", GROWTH_GOAL), ("sinks", GROWTH_GOAL), ("full", None), ("hand-window", None))
# The last run against the streaming layout class, before its removal (it cannot run now).
STREAMING_LAYOUT_RUN = "variant_cost_bench_streaming_layout.json"


def _streaming_layout_rows(out_dir: str) -> list:
  """That run's sinks4-window1020 / streaming layout rows, marked recorded (none where
  the file is absent)."""
  path = os.path.join(out_dir, STREAMING_LAYOUT_RUN)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = json.load(f)["rows"]
  return [dict(row, what=f"{row['what']} (recorded before its removal)") for row in rows
          if row["what"].startswith("sinks / streaming")]


def _engine(cfg, model, kind: str, max_model_len: int) -> kvjax.Engine:
  """An Engine of one request slot running `kind` (KINDS) on `model` (no window)."""
  attention = {"window": sliding_window(cfg.window),
               "sinks": sinks_window(cfg.sinks, cfg.sinks_window)}.get(kind)
  if kind == "hand-window":
    model = kvjax.Model(model.config.replace(sliding_window=cfg.window), model.params)
  return kvjax.Engine(model, max_num_seqs=1, max_num_batched_tokens=cfg.chunk,
                      max_model_len=max_model_len, prefix_cache=False,
                      num_scheduler_steps=cfg.num_scheduler_steps, attention=attention)


def _decoding(engine: kvjax.Engine, prompt: list, max_new_tokens: int) -> str:
  """Queue `prompt` on `engine` and step through its prefill -> the request id."""
  request_id = engine.add_request(prompt, max_new_tokens, ignore_eos=True)
  while not engine.request(request_id).output_ids:
    engine.step()
  return request_id


def _prefill(engine: kvjax.Engine, prompt: list) -> list:
  """One request of `prompt` through its chunks to its first token -> that token."""
  request_id = engine.add_request(prompt, 1, ignore_eos=True)
  outputs = []
  while engine.has_unfinished:
    outputs += [o for o in engine.step() if o.request_id == request_id]
  return [i for o in outputs for i in o.new_token_ids]


def main(_):
  cfg = _CONFIG.value
  start = time.perf_counter()
  rng = np.random.default_rng(cfg.seed)
  model = kvjax.load_checkpoint(None if cfg.checkpoint == "default" else cfg.checkpoint)
  steps = 1 + cfg.repeats * cfg.inner  # decode steps each run takes (untimed call included)
  max_model_len = max(cfg.contexts) + steps + 2
  model = kvjax.Model(model.config.replace(
      max_position_embeddings=max(max_model_len, model.config.max_position_embeddings)),
      model.params)
  vocab = model.config.vocab_size - 3  # bytes, not the special ids
  print(f"issue 49 goals: a variant's step <= {COST_GOAL}x the hand-written path; window"
        f"{cfg.window} and sinks{cfg.sinks}-window{cfg.sinks_window} decode at "
        f"{max(cfg.contexts)} <= {GROWTH_GOAL}x at {min(cfg.contexts)}", flush=True)
  runs, decoding = {}, {}
  for context in cfg.contexts:
    prompt = rng.integers(0, vocab, context).tolist()
    for kind in KINDS:
      engine = _engine(cfg, model, kind, max_model_len)
      decoding[kind, context] = (engine, _decoding(engine, prompt, steps + 2))
      runs[f"decode {kind} {context}"] = engine.step
  prompt = rng.integers(0, vocab, cfg.prefill_tokens).tolist()
  for kind in KINDS:
    engine = _engine(cfg, model, kind, cfg.prefill_tokens + 1)
    runs[f"prefill {kind}"] = functools.partial(_prefill, engine, prompt)
  timings = common.interleaved(runs, cfg.repeats, inner=cfg.inner)
  medians = timings.medians()
  chunks = -(-cfg.prefill_tokens // cfg.chunk)
  seconds = {name: s / chunks if name.startswith("prefill") else s
             for name, s in medians.items()}
  tokens = {key: engine.request(request_id).output_ids
            for key, (engine, request_id) in decoding.items()}
  pages_held = {f"{kind} {context}": engine.scheduler.allocator.num_used
                for (kind, context), (engine, _) in decoding.items()}
  first = {name.split()[1]: timings.first_results[name] for name in runs
           if name.startswith("prefill")}
  rows = []
  for variant, hand in PAIRS:
    for context in cfg.contexts:
      rows.append(dict(
          what=f"{variant} / {hand} decode step at {context}", goal=COST_GOAL,
          ours=seconds[f"decode {variant} {context}"] / seconds[f"decode {hand} {context}"],
          same_tokens=tokens[variant, context] == tokens[hand, context]))
    rows.append(dict(what=f"{variant} / {hand} prefill chunk of {cfg.chunk}", goal=COST_GOAL,
                     ours=seconds[f"prefill {variant}"] / seconds[f"prefill {hand}"],
                     same_tokens=first[variant] == first[hand]))
  short, long = min(cfg.contexts), max(cfg.contexts)
  for kind, goal in GROWTH:
    rows.append(dict(what=f"{kind} decode step {long} / {short}", goal=goal,
                     ours=seconds[f"decode {kind} {long}"] / seconds[f"decode {kind} {short}"]))
  for name, s in seconds.items():
    print(f"{name:28s} {s * 1e3:8.3f} ms", flush=True)
  print(f"pages held by each decode request: {pages_held}")
  claims = common.claim_rows([
      ("49", r["what"] + ("" if "same_tokens" not in r else
                          f" (greedy tokens {'equal' if r['same_tokens'] else 'DIFFER'})"),
       "grows" if r["goal"] is None else f"<= {r['goal']}x", r["ours"])
      for r in rows + _streaming_layout_rows(cfg.out_dir)])
  print()
  common.print_claims(claims, "{claim:3s} {what:100s} {seed:>8s} {ours:>7s}", "{:.3f}")
  result = dict(config=cfg.to_dict(), device=common.device_label(),
                device_info=common.describe_device(), shared_machine=True,
                seconds=time.perf_counter() - start, step_seconds=seconds,
                samples=timings.seconds, pages_held=pages_held, rows=rows, claims=claims)
  common.write_results(cfg.out_dir, cfg.name, result,
                       plot=functools.partial(_plot, seconds, cfg))


def _plot(seconds: dict, cfg, path: str):
  with common.figure(path, 1, 2, figsize=(11, 4)) as (_, (decode, prefill)):
    width = 0.8 / len(cfg.contexts)
    for i, context in enumerate(cfg.contexts):
      decode.bar(np.arange(len(KINDS)) + i * width, width=width, label=f"context {context}",
                 height=[seconds[f"decode {kind} {context}"] * 1e3 for kind in KINDS])
    decode.set_xticks(np.arange(len(KINDS)) + width * (len(cfg.contexts) - 1) / 2, KINDS)
    decode.set_ylabel("ms per decode step (median)")
    decode.set_title("Engine decode step, one request")
    decode.legend()
    prefill.bar(KINDS, [seconds[f"prefill {kind}"] * 1e3 for kind in KINDS])
    prefill.set_ylabel(f"ms per {cfg.chunk}-token chunk (median)")
    prefill.set_title(f"prefill of {cfg.prefill_tokens} tokens")


if __name__ == "__main__":
  app.run(main)
