"""The Engine's one-shot API: `generate` runs prompts to completion on the continuous-
batching loop and summarizes them (kvjax.generate's GenerateResult).

`EngineGenerate` is a mixin of kvjax/engine/engine.py's Engine (its scheduler, stats, step
log, lock, `_add_request` and `_step`), kept apart because a batch run with its stats is
its own job beside the request API; `run_until_finished` is shared with kvjax/engine/router.py.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence, Union

from kvjax.engine.metrics import summarize
from kvjax.engine.validation import per_prompt_seeds
from kvjax.runtime.generation import GenerateResult, validate_prompts

__all__ = ["EngineGenerate", "run_until_finished"]


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


class EngineGenerate:
  """generate for an Engine (kvjax/engine/engine.py)."""

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               temperature: float = 0.0, top_k: Optional[int] = None,
               top_p: Optional[float] = None, seed: Union[int, Sequence[int]] = 0,
               stop: Union[None, int, Sequence[int]] = None,
               cache_salt: Optional[str] = None) -> GenerateResult:
    """Run `prompts` to completion -> GenerateResult(tokens per prompt, stats).

    Every prompt is validated before any is queued, so bad input changes
    nothing.  `seed` is one int or one per prompt.  stats["finish_reasons"]
    says how each request ended ("stop", "length", or "error": see the module doc).
    """
    with self._lock:
      return self._generate(prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, stop=stop, cache_salt=cache_salt)

  def _generate(self, prompts, max_new_tokens, *, temperature, top_k, top_p, seed, stop,
                cache_salt) -> GenerateResult:
    prompts = validate_prompts(self.model_config, prompts, max_new_tokens)
    seeds = per_prompt_seeds(seed, len(prompts))
    for i, prompt in enumerate(prompts):  # all of them before any is queued
      self.scheduler.check_fits(f"prompt {i}", len(prompt), max_new_tokens)
    before = self.stats()
    mark = self.steps.num_recorded
    start = time.perf_counter()
    ids = [self._add_request(p, max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=s, stop=stop, cache_salt=cache_salt)
           for p, s in zip(prompts, seeds)]
    done, others = run_until_finished(self._step, ids)
    wall = time.perf_counter() - start
    steps = self.steps.since(mark)
    self._pending = others + self._pending
    stats = summarize([done[rid].metrics for rid in ids], steps, wall,
                      **self.stats().counted_since(before))
    stats["finish_reasons"] = [done[rid].finish_reason for rid in ids]
    stats["cache"] = "paged"
    stats["speculative"] = (None if not self.num_draft else self.config.speculative
                            if self.draft_model is None else self.draft_model.config.name)
    return GenerateResult(tokens=[done[rid].output_ids for rid in ids], stats=stats)
