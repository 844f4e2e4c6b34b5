"""vLLM's per-request logit processing, on the device, per row: logit_bias, min_tokens,
repetition / presence / frequency penalties, min_p.

`LogitProcessing` rides in `SamplingParams.processing` (kvjax/runtime/sampling.py), which
calls its `apply` on the logits before temperature, top-k/top-p and greedy choice,
in vLLM's order: logit_bias (OpenAI's: added to the logit), min_tokens (a row's stop
ids, EOS included unless ignore_eos, get -inf while it has emitted fewer than
min_tokens), then the penalties of vLLM's apply_penalties:
  repetition r, on ids in the prompt or the output: logit / r if logit > 0 else logit * r;
  frequency f and presence p, on output ids:       logit - f * count - p * (count > 0).
min_p runs later, where vLLM runs it: on the temperature-scaled logits, before top-k and
top-p (`min_p_filtered`, called by kvjax/runtime/sampling.py; greedy rows never need it, since it
keeps the likeliest token).
Reported logprobs stay the model's raw ones (vLLM's default, raw_logprobs).
Every group the engine packs carries a LogitProcessing, so one step program
serves rows with and without these fields (nothing compiles on a request's first
penalty): a group with no such row carries the neutral one (`active` False, its
host arrays made once per row count and reused), whose `apply` a cond in
kvjax/runtime/sampling.py skips; the cost left is its copy to the device, [B, V] x 10
bytes a step.  A group with such a row pays [B, V] element-wise work and builds
the host arrays below per step.  Inside a multi-step burst (kvjax/runtime/serve_steps.py)
`advance` counts each step's emitted ids.
Shapes: docs/DIMENSIONS.md.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = ["LogitProcessing", "pack_processing", "with_processing"]


@struct.dataclass
class LogitProcessing:
  """Per-row processing state of a row group; neutral rows change no logit."""

  bias: jax.Array  # [B, V] f32 added to the logits (logit_bias; 0: none)
  stop_mask: jax.Array  # [B, V] bool ids banned while min_left > 0 (a row's stop ids)
  min_left: jax.Array  # [B] int32 tokens still to emit before a stop id may come
  prompt_mask: jax.Array  # [B, V] bool ids in the row's prompt
  output_counts: jax.Array  # [B, V] int32 times each id was emitted so far
  repetition: jax.Array  # [B] f32 (1: off)
  presence: jax.Array  # [B] f32 (0: off)
  frequency: jax.Array  # [B] f32 (0: off)
  min_p: jax.Array  # [B] f32 (0: off)
  active: jax.Array  # [] bool: some row asks (False: sampling skips `apply`)

  @classmethod
  def neutral(cls, b: int, vocab: int, active: bool = False) -> "LogitProcessing":
    """Host arrays for B rows that change no logit (padding rows; a warm-up's batch)."""
    return cls(bias=np.zeros((b, vocab), np.float32), stop_mask=np.zeros((b, vocab), bool),
               min_left=np.zeros(b, np.int32), prompt_mask=np.zeros((b, vocab), bool),
               output_counts=np.zeros((b, vocab), np.int32), repetition=np.ones(b, np.float32),
               presence=np.zeros(b, np.float32), frequency=np.zeros(b, np.float32),
               min_p=np.zeros(b, np.float32), active=np.bool_(active))

  def apply(self, logits: jax.Array) -> jax.Array:
    """logits [B, V] f32 -> processed logits [B, V] f32."""
    logits = logits + self.bias
    logits = jnp.where(self.stop_mask & (self.min_left > 0)[:, None], -jnp.inf, logits)
    seen = self.prompt_mask | (self.output_counts > 0)
    r = jnp.where(seen, self.repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / r, logits * r)
    return (logits - self.frequency[:, None] * self.output_counts
            - self.presence[:, None] * (self.output_counts > 0))

  def min_p_filtered(self, scaled: jax.Array) -> jax.Array:
    """Temperature-scaled logits [B, V] with -inf where a token's probability is below
    min_p x its row's largest: p / p_max = exp(logit - max), compared in log space, so no
    softmax underflow decides it (min_p 0: log 0 = -inf keeps every token)."""
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(self.min_p)[:, None]
    return jnp.where(scaled >= floor, scaled, -jnp.inf)

  def advance(self, emitted: jax.Array) -> "LogitProcessing":
    """Count a step's emitted ids [B, J+1] (-1: none) into the state."""
    valid = emitted >= 0
    rows = jnp.arange(emitted.shape[0])[:, None]
    counts = self.output_counts.at[rows, jnp.maximum(emitted, 0)].add(valid.astype(jnp.int32))
    return self.replace(output_counts=counts,
                        min_left=self.min_left - jnp.sum(valid, axis=1, dtype=jnp.int32))


@functools.lru_cache(maxsize=64)
def _neutral(b: int, vocab: int) -> LogitProcessing:
  """The inactive processing of B rows, made once (never written: pack_processing builds
  fresh arrays for a group that asks)."""
  return LogitProcessing.neutral(b, vocab)


def pack_processing(requests: Sequence, b: int, vocab: int) -> LogitProcessing:
  """Host arrays for a group's requests (row j: requests[j]; rows beyond: padding)
  -> LogitProcessing; the shared neutral one when no request asks for any processing."""
  if not any(r.sampling.processed for r in requests):
    return _neutral(b, vocab)
  p = LogitProcessing.neutral(b, vocab, active=True)
  for j, req in enumerate(requests):
    s = req.sampling
    if not s.processed:
      continue
    for token, value in s.logit_bias:
      p.bias[j, token] = value
    p.stop_mask[j, sorted(req.stop_token_ids)] = True
    p.min_left[j] = max(s.min_tokens - req.num_output_tokens, 0)
    p.prompt_mask[j, list(req.prompt_ids)] = True
    np.add.at(p.output_counts[j], np.asarray(req.output_ids, np.int64), 1)
    p.repetition[j], p.presence[j], p.frequency[j] = (s.repetition_penalty, s.presence_penalty,
                                                      s.frequency_penalty)
    p.min_p[j] = s.min_p
  return p


def with_processing(batch, requests: Sequence, vocab: int):
  """A packed StepBatch whose sampling carries its requests' processing (neutral if none
  asks; padding rows are neutral rows)."""
  processing = pack_processing(requests, batch.tokens.shape[0], vocab)
  return batch.replace(sampling=batch.sampling.replace(processing=processing))
