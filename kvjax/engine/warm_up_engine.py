"""The Engine's warm-up: every step program it can run, compiled before it serves.

`EngineWarmUp` is a mixin of kvjax/engine/engine.py's Engine (its packing, draft policy,
scheduler, lock and `_run`), kept apart because compiling ahead is its own job:
kvjax/engine/warm_up.py plans and paces the runs, this module forms them for one engine.
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from kvjax.engine.sched.batching import StepShape, burst_limits
from kvjax.engine.sched.ngram import host_draft_shapes
from kvjax.engine.warm_up import WarmUp, WarmUpPlan, draft_counts, warm_up
from kvjax.runtime.logit_processors import with_processing

__all__ = ["EngineWarmUp"]


class EngineWarmUp:
  """warm_up / warm_up_plan for an Engine (kvjax/engine/engine.py)."""

  def warm_up(self, *, progress: Optional[str] = None, **variants) -> WarmUp:
    """Compile every step program this engine can run, before it serves -> WarmUp
    (programs compiled, programs run, seconds); kvjax/engine/warm_up.py.

    Runs serve_step / serve_burst once per shape its packing can form
    (Packing.shapes), per draft count its policy may pick and per burst stop width, on
    padding-only batches, and the page copy / clear programs on the null page, so
    no request waits on XLA and nothing a request reads changes.  variants: WarmUpPlan's
    stop_widths (the bursts of requests with stop ids), map_budget and prompt_logprobs (the
    prefill programs that score prompts).  progress: a progress bar's label.
    """
    with self._lock:
      return warm_up(self.warm_up_plan(**variants), progress)

  def warm_up_plan(self, **variants) -> WarmUpPlan:
    """`warm_up`'s programs, to run one at a time (a server's warm-up thread: between requests)."""
    counts = draft_counts(self.draft_policy, self.num_draft)
    shapes = self.packing.shapes((0, *counts) if self.ngram else counts,
                                 bursts=self.scheduler.num_scheduler_steps > 1)
    if self.ngram is not None:
      shapes = host_draft_shapes(shapes, counts)
    return WarmUpPlan(shapes, self._run_padding, prepare=self._warm_up_pages,
                      finish=lambda: jax.block_until_ready(self.state), **variants)

  def _warm_up_pages(self) -> None:
    with self._lock:
      if self.config.prefix_cache and self.config.prefix_match == "token":
        self._copy_pages([])
      self._clear([], self.config.max_num_seqs)  # the scratch slot

  def _run_padding(self, shape: StepShape, stop_width: int = 1,
                   score_prompt: bool = False) -> None:
    """One step program of `shape` on padding rows (a burst's: none runs a step), its
    stop-id array `stop_width` wide (score_prompt: the prefill program scoring prompts)."""
    with self._lock:
      batch = with_processing(self.packing.padding(shape, snapshots=self.snapshots is not None),
                              [], self.model_config.vocab_size)  # neutral, as every group's
      burst = None
      if shape.kind == "burst":
        left, _ = burst_limits([], shape.rows)
        burst = (left, np.full((shape.rows, stop_width), -1, np.int32), 1)
      self._run(batch, shape.num_draft, False, burst, score_prompt=score_prompt)
