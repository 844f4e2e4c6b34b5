"""One row group's device program: serve_step, or serve_burst for a multi-step plan,
dispatched without a host sync on the engine's state, which goes in and comes out.

What the Engine's step and its warm-up both run (kvjax/engine/engine.py `_run`).
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from kvjax.constraints import ConstraintBook
from kvjax.runtime.serve_steps import EngineState, serve_burst, serve_step

__all__ = ["dispatch"]


def dispatch(model, draft_model, state: EngineState, batch, *, backend, num_draft: int,
             host_drafts: bool, max_steps: int, logprobs: bool, burst=None,
             mask: Optional[np.ndarray] = None, score_prompt: bool = False) -> tuple:
  """serve_step (token mask [rows, J+1, Vb], or None: all ones), or serve_burst when
  burst = (left [B], stop ids [B, E], steps) -> (state, Emitted [U, B, ...], drafted
  [U, B], steps run).  draft_model: the MTP drafter or None (an n-gram engine's J = 0
  programs are the plain engine's); logprobs: a row asks for them (else the Emitted
  leaves them out: no host copy); score_prompt: a prefill row is owed prompt logprobs
  (serve_step's program that scores its columns; a burst runs decode rows only)."""
  config = model.config
  static = dict(config=config, draft_config=draft_model and draft_model.config,
                backend=backend, num_draft=num_draft, host_drafts=host_drafts)
  draft_params = draft_model and draft_model.params
  want_logprobs = np.bool_(logprobs)  # traced: one program serves both
  if burst is None:
    mask = ConstraintBook.step_mask(mask, batch.tokens.shape[0], num_draft + 1,
                                    config.vocab_size)  # one program either way
    state, emitted = serve_step(model.params, draft_params, state, batch, token_mask=mask,
                                want_logprobs=want_logprobs, score_prompt=score_prompt,
                                **static)
    emitted, drafted, steps = jax.tree.map(lambda x: x[None], emitted), batch.num_draft[None], 1
  else:
    left, stop_ids, num_steps = burst
    state, emitted, drafted, steps = serve_burst(
        model.params, draft_params, state, batch, left, stop_ids, np.int32(num_steps),
        want_logprobs, max_steps=max_steps, **static)
  if not logprobs:
    emitted = emitted.replace(logprobs=None, top_ids=None, top_logprobs=None)
  return state, emitted, drafted, steps
