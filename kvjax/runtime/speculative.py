"""Speculative decoding (claims C9-C11) as pure pieces of one jitted step.

A step that samples ends with a draft: the MTP modules of the model (DeepSeek-V3
style, kvjax/model/decoder.py `mtp_block`) chain from the last accepted position L,
whose trunk logits emitted x_{L+1}:
  module 0: h1_L = M0(h0_L, embed(x_{L+1}))  -> d1 ~ x_{L+2}
  module 1: h2_L = M1(h1_L, embed(d1))       -> d2 ~ x_{L+3}
The next step feeds [x_{L+1}, d1, .., dJ] in ONE trunk forward (a prefill-like
row, C9); `accept` keeps the longest prefix the rejection rule passes and adds
one corrected or bonus token (C10), so a row emits 1..J+1 tokens.  Rejected
positions need no device rollback: the scheduler frees their pages and the
next step sets each slot's length from the host, so their K/V is overwritten
before anything attends to it.

A separate draft model (same vocabulary) is the other drafter: it keeps its own
paged K/V on the same pages and block tables, and proposes d1..dJ
autoregressively from x_{L+1} (`model_draft`).  Prompt lookup (kvjax/engine/sched/ngram.py)
drafts on the host from the row's own tokens; its drafts arrive in the batch's
draft columns and verify as point masses (`accept` with no draft_probs).

The MTP modules attend over their own K/V (cache layers num_layers + depth,
the C11 memory cost), written for every position the trunk computes, with the
same shifted inputs as in training (`forward_with_mtp`): module d at position t
sees h_d at t and x_{t+d+1}.  Where x_{t+d+1} is not known yet (the tail of a
row) the draft stands in; that only affects draft quality, never the output.

Randomness is per request, as in kvjax/runtime/sampling.py: every draw folds the
request's seed with the sequence position it decides, so a request's tokens do
not depend on its batch.  The accept rule is the backend's `verify`
(kvjax/attention/backends.py: pallas_kernels' fused `rejection_sample`, or its jnp
reference), called once for the whole batch with one key per row; a batch
whose rows are all greedy takes `greedy_verify` and an argmax drafter instead
(lax.cond), which draw nothing and give the same tokens.

Shapes: docs/DIMENSIONS.md (B rows, T columns, J drafts per row, V vocab, D
model dim).
"""
from __future__ import annotations

from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import greedy_verify
from kvjax.attention.backends import Backend
from kvjax.model.config import ModelConfig
from kvjax.model.decoder import decoder, lm_logits, mtp_block
from kvjax.model.params import Params
from kvjax.runtime.sampling import SamplingParams, filtered_if_asked, greedy_tokens
from kvjax.runtime.step_batch import StepBatch
from kvjax.runtime.steps import cache_attend

__all__ = ["check_mtp", "check_draft_model", "fill_drafts", "gather_rows",
           "target_logits_for_accept", "accept", "mtp_draft", "model_draft"]

_ACCEPT_STREAM, _DRAFT_STREAM = 0, 1  # fold_in tags: independent draws per position


def check_mtp(config: ModelConfig, params: Params, num_draft: int) -> None:
  """ValueError unless the model still carries >= num_draft MTP modules (C11)."""
  if num_draft < 1:
    raise ValueError(f"num_draft must be >= 1 with speculative decoding, got {num_draft}")
  have = min(config.mtp_num_hidden_layers, len(params.mtp))
  if num_draft > have:
    raise ValueError(
        f"speculative='mtp' with num_draft={num_draft} needs {num_draft} MTP modules; "
        f"model {config.name!r} has mtp_num_hidden_layers={config.mtp_num_hidden_layers} "
        f"and {len(params.mtp)} MTP weight sets")


def check_draft_model(config: ModelConfig, draft_config: ModelConfig, num_draft: int) -> None:
  """ValueError unless a separate draft model can propose tokens for `config`."""
  if num_draft < 1:
    raise ValueError(f"num_draft must be >= 1 with speculative decoding, got {num_draft}")
  if draft_config.vocab_size != config.vocab_size:
    raise ValueError(f"draft model vocab_size {draft_config.vocab_size} != target "
                     f"vocab_size {config.vocab_size}")
  if draft_config.attention_type != "gqa":
    raise ValueError(f"draft model attention_type must be 'gqa', got "
                     f"{draft_config.attention_type!r}")


def _draw(logits: jax.Array, sampling: SamplingParams, positions: jax.Array):
  """Draft token and distribution per row: logits [B, V] -> (ids [B], probs [B, V]).

  An all-greedy batch skips the per-row keys and the softmax: its drafter is
  deterministic, so its distribution is the one-hot of the argmax.
  """
  def greedy_only():
    draft = greedy_tokens(logits)
    return draft, jax.nn.one_hot(draft, logits.shape[-1], dtype=jnp.float32)

  def mixed():
    greedy = sampling.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, sampling.temperature)[:, None]
    keys = _row_key(sampling.seeds, positions, _DRAFT_STREAM)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    draft = jnp.where(greedy, greedy_tokens(scaled), drawn)
    return draft, jax.nn.softmax(scaled, axis=-1)

  return lax.cond(jnp.all(sampling.temperature <= 0), greedy_only, mixed)


def _row_key(seeds: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
  """[B] per-request keys for the draw that decides sequence index positions[b]."""
  return jax.vmap(lambda s, p: jax.random.fold_in(
      jax.random.fold_in(jax.random.PRNGKey(s), p), stream))(seeds, positions)


def fill_drafts(tokens: jax.Array, drafts: jax.Array, num_draft: jax.Array) -> jax.Array:
  """tokens [B, T] with column 0 known; columns 1..num_draft[b] <- drafts [B, J]."""
  t, k = tokens.shape[1], drafts.shape[1]
  col = jnp.arange(t)[None, :]  # [1, T]
  taken = drafts[:, jnp.clip(jnp.arange(t) - 1, 0, k - 1)]  # [B, T]
  return jnp.where((col >= 1) & (col <= num_draft[:, None]), taken, tokens)


def gather_rows(x: jax.Array, start: jax.Array, count: int) -> jax.Array:
  """x [B, T, ...] -> [B, count, ...] at rows start[b] + j (clipped into [0, T))."""
  index = jnp.clip(start[:, None] + jnp.arange(count)[None, :], 0, x.shape[1] - 1)
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def target_logits_for_accept(logits: jax.Array, sampling: SamplingParams,
                             use_filter: bool) -> jax.Array:
  """logits [B, J+1, V] with top-k / top-p applied (-inf outside), temperature left in.

  The accept rule scales by temperature itself; filtering the scaled logits and
  masking the raw ones keeps the nucleus of the tempered distribution.
  """
  if not use_filter:
    return logits
  b, r, v = logits.shape
  temperature = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
  scaled = (logits / temperature[:, None, None]).reshape(b * r, v)
  kept = filtered_if_asked(scaled, jnp.repeat(sampling.top_k, r), jnp.repeat(sampling.top_p, r))
  return jnp.where(jnp.isfinite(kept.reshape(b, r, v)), logits, -jnp.inf)


def accept(logits: jax.Array, drafts: jax.Array, draft_probs: Optional[jax.Array],
           num_draft: jax.Array, sampling: SamplingParams, positions: jax.Array,
           backend: Backend):
  """Rejection-sample every row (C10) in one call of the backend's verifier, a key per row.

  logits [B, J+1, V] (target at the fed token and each draft), drafts [B, J],
  draft_probs [B, J, V] (None: point masses on the drafts, as for n-gram drafts that
  a deterministic rule proposed), num_draft [B], positions [B] = sequence index of
  the first token emitted -> (tokens [B, J+1] padded with -1, num_accepted [B]).
  A draft whose distribution holds a NaN or inf (broken MTP or draft weights) is
  rejected: the row verifies only the drafts before it, and its token there is
  drawn from the target, so the output keeps the target distribution.
  """
  def greedy_only():
    return greedy_verify(drafts, logits, num_draft)

  def mixed():
    keys = _row_key(sampling.seeds, positions, _ACCEPT_STREAM)
    if draft_probs is None:  # built here: an all-greedy batch never needs them
      return backend.verify(drafts, jax.nn.one_hot(drafts, logits.shape[-1], dtype=jnp.float32),
                            logits, num_draft, keys, temperature=sampling.temperature)
    usable = jnp.all(jnp.isfinite(draft_probs), axis=-1)  # [B, J]
    first_bad = jnp.argmin(jnp.concatenate(
        [usable, jnp.zeros_like(usable[:, :1])], axis=1), axis=1)  # [B]: J if all usable
    probs = jnp.where(usable[..., None], draft_probs, 0.0)
    return backend.verify(drafts, probs, logits, jnp.minimum(num_draft, first_bad), keys,
                          temperature=sampling.temperature)

  # An all-greedy batch needs no noise (per-row threefry draws are many small ops on CPU).
  return lax.cond(jnp.all(sampling.temperature <= 0), greedy_only, mixed)


def mtp_draft(params: Params, config: ModelConfig, cache, batch: StepBatch, hidden: jax.Array,
              next_tokens: jax.Array, last: jax.Array, backend, num_draft: int):
  """Run the MTP chain over the step's rows and draft from each row's last accepted column.

  batch: the step's StepBatch (the trunk's, unchanged); hidden [B, T, D]: trunk
  output at its columns; next_tokens [B, T]: x_{t+1} per column (the emitted
  token at `last`); last [B]: column of the last accepted position.  Writes MTP
  K/V at every real column -> (cache, drafts [B, J] int32, draft_probs [B, J, V] f32).
  """
  t = next_tokens.shape[1]
  attend = cache_attend(config, batch, backend)  # the MTP layers read the trunk's batch
  at_last = jnp.arange(t)[None, :] == last[:, None]  # [B, T]
  last_position = jnp.take_along_axis(batch.positions, last[:, None], axis=1)[:, 0]
  drafts, probs = [], []
  for depth in range(num_draft):
    cache, hidden = mtp_block(params, config, depth, hidden, next_tokens, batch.positions,
                              cache, attend)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = lm_logits(params, config, h_last, params.mtp[depth].out_norm)
    draft, prob = _draw(logits, batch.sampling, last_position + depth + 2)
    drafts.append(draft)
    probs.append(prob)
    # Module depth+1 at t reads x_{t+depth+2}: shift left, the new draft at `last`.
    shifted = jnp.concatenate([next_tokens[:, 1:], next_tokens[:, -1:]], axis=1)
    next_tokens = jnp.where(at_last, draft[:, None], shifted)
  return cache, jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1)


def model_draft(draft_params: Params, draft_config: ModelConfig, cache, batch: StepBatch,
                last: jax.Array, following: jax.Array, backend, num_draft: int):
  """A separate draft model proposes J tokens autoregressively after the accepted prefix.

  One forward over the row's accepted columns plus the emitted token (column
  last + 1, which yields d1) keeps the draft cache in step with the target's;
  J - 1 single-column forwards yield d2..dJ.  Positions past the row's pages
  write to the null page: only draft quality depends on them.
  batch: the step's StepBatch (tokens with drafts filled); last [B]; following
  [B] the emitted token -> (cache, drafts [B, J], draft_probs [B, J, V]).
  """
  b, t = batch.tokens.shape
  col = jnp.arange(t + 1)[None, :]
  fed = jnp.where(col == (last + 1)[:, None], following[:, None],
                  jnp.pad(batch.tokens, ((0, 0), (0, 1))))  # [B, T + 1]
  rows = batch.with_columns(fed, jnp.where(batch.q_lens > 0, last + 2, 0))
  cache, hidden = decoder(draft_params, draft_config, rows.tokens, rows.positions, cache,
                          cache_attend(draft_config, rows, backend))
  h = jnp.take_along_axis(hidden, (last + 1)[:, None, None], axis=1)[:, 0]  # [B, D]
  position = batch.starts + last + 2  # sequence index of d1
  draft, prob = _draw(lm_logits(draft_params, draft_config, h), batch.sampling, position)
  drafts, probs = [draft], [prob]
  one = rows.with_columns(draft[:, None], jnp.minimum(batch.q_lens, 1))
  for _ in range(num_draft - 1):
    one = one.at_starts(position, one.q_lens).replace(tokens=draft[:, None])
    cache, hidden = decoder(draft_params, draft_config, one.tokens, one.positions, cache,
                            cache_attend(draft_config, one, backend))
    position = position + 1
    draft, prob = _draw(lm_logits(draft_params, draft_config, hidden[:, 0]), batch.sampling,
                        position)
    drafts.append(draft)
    probs.append(prob)
  return cache, jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1)
