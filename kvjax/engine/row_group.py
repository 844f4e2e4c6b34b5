"""A step's row group, packed and launched: the Engine's rows -> one StepBatch -> its
device program (kvjax/engine/dispatch.py), without a host sync.

`launch` is the Engine's collaborator for it (kvjax/engine/engine.py `_step` calls it per
row group): it reads the engine's drafts (n-gram or the slots' fresh ones), constraint
masks, packing and sampling options, and runs the group through the engine's `_run`.
"""
from __future__ import annotations

import numpy as np

from kvjax.engine.requests import SchedulerOutput
from kvjax.engine.sched.batching import burst_limits
from kvjax.engine.sched.ngram import with_drafts
from kvjax.runtime.logit_processors import with_processing

__all__ = ["launch"]


def launch(engine, plan: SchedulerOutput, group: list[int], num_draft: int, snapshots):
  """Pack one row group and dispatch serve_step or serve_burst (no host sync).

  Rows verify at most the fresh drafts their slot holds and num_draft; every
  sampling row drafts num_draft anew.  An n-gram row verifies what its history
  proposes, and counts its every draft slot as drafted (one it could not fill
  is a rejection to the metrics and the draft policy).  -> ((B, T), Emitted
  [U, B, ...], drafted [U, B], steps run), U = 1 unless the plan is a burst.
  """
  rows = [plan.rows[i] for i in group]
  drafts = engine.ngram and engine.ngram.propose([r.request for r in rows], num_draft,
                                                 engine.scheduler.requests)
  # Masks per verified position; device drafts are not read back: constrained rows skip them.
  mask, drafts = engine.constraints.masks(rows, num_draft + 1, drafts)
  if engine.ngram is not None:
    verify = [len(d) for d in drafts]
  else:
    verify = [0 if r.request_id in engine.constraints else
              min(num_draft, engine._fresh_drafts.get(r.request_id, 0)) for r in rows]
  batch = engine.packing.pack(plan, group, verify, num_draft, snapshots)
  if engine.ngram is not None:
    batch = with_drafts(batch, drafts)
  batch = with_processing(batch, [r.request for r in rows], engine.model_config.vocab_size)
  logprobs = any(r.request.sampling.logprobs is not None for r in rows)
  score_prompt = any(not r.is_decode and r.request_id in engine._prompt_scores for r in rows)
  burst = None if plan.num_steps == 1 else (
      *burst_limits(rows, batch.tokens.shape[0]), plan.num_steps)
  emitted, drafted, steps = engine._run(batch, num_draft, logprobs, burst, mask, score_prompt)
  if engine.ngram is not None and burst is None:
    drafted = np.array([[min(r.num_draft, num_draft) for r in rows]], np.int32)
  return batch.tokens.shape, emitted, drafted, steps
