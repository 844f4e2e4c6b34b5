"""The Engine's one-shot API: `generate` runs prompts to completion on the continuous-
batching loop and summarizes them (kvjax.generate's GenerateResult).

`generate(engine, ...)` is the Engine's collaborator for it (kvjax/engine/engine.py
`Engine.generate` calls it under the engine's lock; it uses the engine's scheduler, stats,
step log, `_add_request` and `_step`), kept apart because a batch run with its stats is its
own job beside the request API; `run_until_finished` is shared with kvjax/engine/router.py.
"""
from __future__ import annotations

import time
from typing import Sequence

from kvjax.engine.metrics import summarize
from kvjax.engine.validation import per_prompt_seeds
from kvjax.runtime.generation import GenerateResult, validate_prompts

__all__ = ["generate", "run_until_finished"]


def run_until_finished(step, ids: Sequence[str]) -> tuple[dict, list]:
  """Call step() until every request in ids has finished -> (id: its final output,
  the other requests' outputs seen meanwhile, for their own caller)."""
  done, others, mine = {}, [], set(ids)
  while len(done) < len(ids):
    for out in step():
      if out.request_id not in mine:
        others.append(out)
      elif out.finished:
        done[out.request_id] = out
  return done, others


def generate(engine, prompts, max_new_tokens, *, temperature, top_k, top_p, seed, stop,
             cache_salt) -> GenerateResult:
  """Run `prompts` to completion on `engine` (its lock held) -> GenerateResult; every
  prompt is validated before any is queued (Engine.generate)."""
  prompts = validate_prompts(engine.model_config, prompts, max_new_tokens)
  seeds = per_prompt_seeds(seed, len(prompts))
  for i, prompt in enumerate(prompts):  # all of them before any is queued
    engine.scheduler.check_fits(f"prompt {i}", len(prompt), max_new_tokens)
  before = engine.stats()
  mark = engine.steps.num_recorded
  start = time.perf_counter()
  ids = [engine._add_request(p, max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=s, stop=stop, cache_salt=cache_salt)
         for p, s in zip(prompts, seeds)]
  done, others = run_until_finished(engine._step, ids)
  wall = time.perf_counter() - start
  steps = engine.steps.since(mark)
  engine._pending = others + engine._pending  # other callers' outputs: their next step()
  stats = summarize([done[rid].metrics for rid in ids], steps, wall,
                    **engine.stats().counted_since(before))
  stats["finish_reasons"] = [done[rid].finish_reason for rid in ids]
  stats["cache"] = "paged"
  stats["speculative"] = (None if not engine.num_draft else engine.config.speculative
                          if engine.draft_model is None else engine.draft_model.config.name)
  return GenerateResult(tokens=[done[rid].output_ids for rid in ids], stats=stats)
