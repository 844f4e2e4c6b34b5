"""The engine's device programs: one serve step, its multi-step loop, page copies.

`serve_step` runs one group of scheduled rows (a StepBatch packed on the host
by kvjax/engine/sched/batching.py): the trunk forward, then either one sampled token per
row (plain decoding) or the verification of each row's drafts through the
backend's verifier plus a fresh draft (speculative decoding, C9-C11).  The
host owns every length and block table, so preemption, abort and rejected
drafts need no device rollback: the next batch simply says where each row
sits.  `serve_burst` runs up to U such decode steps in one device while_loop
(multi-step scheduling, C13), its carry moving the rows forward.  Both donate
the state and take the model config, backend and draft count as static
arguments.  A program serves every sampling option: top-k / top-p filtering
runs only when a row asks for it (a cond in kvjax/runtime/sampling.py) and logprobs
only when `want_logprobs` (a traced flag) says a row does, so a server compiles
one program per packed shape (and burst stop-id width), not one per
combination of options (kvjax/engine/warm_up.py).  Prompt logprobs are the exception: a
prefill group with a row that asks for them runs the shape's `score_prompt`
program (a static flag, so no other program computes them), which scores every
column a row at a time.  Shapes: docs/DIMENSIONS.md.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.caches import PagedKVCache, clear_cache_pages, copy_cache_pages
from kvjax.caches.groups import GroupedKVCache
from kvjax.caches.gathered import decode_loop_cache
from kvjax.model.config import ModelConfig
from kvjax.model.decoder import lm_logits
from kvjax.model.params import Params
from kvjax.runtime import speculative as spec
from kvjax.runtime.sampling import MAX_LOGPROBS, apply_token_mask, sample, token_logprobs
from kvjax.runtime.step_batch import StepBatch
from kvjax.runtime.steps import model_step
from kvjax.runtime.xla_options import jit_step

__all__ = ["Emitted", "EngineState", "num_compiled", "serve_step", "serve_burst", "copy_pages",
           "clear_pages"]


@struct.dataclass
class Emitted:
  """What a serve step hands back per row (a burst stacks U of them: [U, B, ...])."""

  tokens: jax.Array  # [B, J+1] int32 emitted ids, -1 from `counts` on
  counts: jax.Array  # [B] int32 ids emitted (0: none, e.g. a failed or padding row)
  failed: jax.Array  # [B] bool: the row's logits were non-finite (see _serve_rows)
  # kvjax/runtime/sampling.py token_logprobs, A = MAX_LOGPROBS; zeros unless want_logprobs
  # (the engine drops them before its host copy then):
  logprobs: Optional[jax.Array] = None  # [B, J+1] f32 log p of each emitted id
  top_ids: Optional[jax.Array] = None  # [B, J+1, A] int32 the likeliest ids there
  top_logprobs: Optional[jax.Array] = None  # [B, J+1, A] f32 their log p
  # Prompt logprobs (a score_prompt program only, else None): token_logprobs of each
  # column's following known id ([B, T], [B, T, A], [B, T, A]; see _prompt_scores).
  prompt: Optional[tuple] = None
  # MoE models only: the fed tokens (every real column, drafts included) each trunk
  # layer routed to each expert, [L, Ne] int32 (kvjax/model/decoder.py decoder's).
  expert_tokens: Optional[jax.Array] = None


def _prompt_scores(params: Params, config: ModelConfig, hidden: jax.Array,
                   batch: StepBatch) -> tuple:
  """hidden [B, T, D] -> token_logprobs of the id following each column: column t scores
  the token at position start + t + 1, the row's next fed id or, after its last known
  id, batch.next_tokens (-1, read as id 0, where the row samples: the host keeps only
  prompt positions).  One row at a time, so no more than one chunk's [T, V] logits
  are ever live."""
  t = batch.tokens.shape[1]
  col = jnp.arange(t)[None, :]
  known = (batch.q_lens - batch.num_draft)[:, None]  # fed ids that are not drafts
  shifted = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], axis=1)
  following = jnp.where(col + 1 < known, shifted, batch.next_tokens[:, None])  # [B, T]

  def one_row(row):
    h, ids = row
    return token_logprobs(lm_logits(params, config, h)[None], ids[None])

  chosen, top_ids, top_logprobs = jax.lax.map(one_row, (hidden, following))
  return chosen[:, 0], top_ids[:, 0], top_logprobs[:, 0]


def _emitted(tokens, counts, failed, logits, want_logprobs: jax.Array,
             prompt: Optional[tuple] = None, expert_tokens=None) -> Emitted:
  """tokens [B, J+1], logits [B, J+1, V] -> Emitted; a failed row emits nothing."""
  counts = jnp.where(failed, 0, counts)
  b, r, v = logits.shape
  a = min(MAX_LOGPROBS, v)
  none = (jnp.zeros((b, r), jnp.float32), jnp.zeros((b, r, a), jnp.int32),
          jnp.zeros((b, r, a), jnp.float32))
  chosen, top_ids, top_logprobs = jax.lax.cond(
      want_logprobs, lambda: token_logprobs(logits, tokens), lambda: none)
  return Emitted(tokens=tokens, counts=counts, failed=failed, logprobs=chosen, top_ids=top_ids,
                 top_logprobs=top_logprobs, prompt=prompt, expert_tokens=expert_tokens)


@struct.dataclass
class EngineState:
  cache: object  # the trunk's (and MTP modules') pages: a kvjax.caches paged cache
  drafts: jax.Array  # [M, J] int32 drafts each slot feeds at its next verify
  draft_probs: jax.Array  # [M, J, V] f32 draft distributions (C10's p_draft)
  draft_cache: Optional[PagedKVCache] = None  # a draft model's KV, same pages and tables


def _serve_rows(params: Params, draft_params: Optional[Params], state: EngineState,
                batch: StepBatch, token_mask: Optional[jax.Array] = None,
                want_logprobs: jax.Array = False, *, config: ModelConfig,
                draft_config: Optional[ModelConfig], backend, num_draft: int,
                host_drafts: bool = False, score_prompt: bool = False):
  """Run one row group -> (state, Emitted).

  num_draft = 0: plain decoding, one token per row sampled as kvjax.generate does.
  num_draft = J: rows verify their drafts (C9-C10) and every row drafts anew, with
  the MTP modules (draft_config None) or the draft model; with host_drafts, the
  drafts are the batch's own draft columns (n-gram drafts the host proposed,
  kvjax/engine/sched/ngram.py), verified as point masses, and nothing drafts on the device.
  failed[b]: row b's target logits (the ones it samples from, or would sample
  from at the end of its chunk) hold a NaN or inf: the model broke on this
  request, whose tokens are then meaningless; the engine finishes it with an
  error and the other rows are unaffected.
  want_logprobs (bool, traced): also return each emitted id's log-probability and the
  likeliest ids (zeros otherwise).
  token_mask [B, J+1, Vb] (constrained decoding, kvjax/constraints/book.py): the
  packed tokens each row may sample at each position, applied before sampling and
  verification, so a draft the grammar forbids is rejected as the target would;
  None (no constrained row) is the unmasked program.  Logprobs stay the raw model's.
  score_prompt (static: a prefill group where a row asked for prompt logprobs): Emitted.prompt
  scores every column's following id (_prompt_scores); other programs compute nothing.
  """
  base = jnp.maximum(batch.q_lens - 1 - batch.num_draft, 0)  # column of the last known token
  if host_drafts:
    pending = spec.gather_rows(batch.tokens, base + 1, num_draft)  # [B, J]
  else:  # a slot keeps up to the engine's most drafts; this program verifies and drafts J
    pending = state.drafts[batch.slot_ids, :num_draft]  # [B, J]
    if num_draft:
      batch = batch.replace(tokens=spec.fill_drafts(batch.tokens, pending, batch.num_draft))
  cache, hidden, *routed = model_step(params, state.cache, batch, config=config,
                                      backend=backend, expert_tokens=config.num_experts > 0)
  expert_tokens = routed[0] if routed else None  # [L, Ne]
  prompt = _prompt_scores(params, config, hidden, batch) if score_prompt else None
  first = batch.starts + base + 1  # sequence index of the first emitted token
  if not num_draft:
    logits = lm_logits(params, config, spec.gather_rows(hidden, base, 1)[:, 0])
    masked = apply_token_mask(logits, None if token_mask is None else token_mask[:, 0])
    new = sample(masked, batch.sampling, first, use_filter=True)  # [B]
    failed = ~jnp.all(jnp.isfinite(logits), axis=-1)
    return state.replace(cache=cache), _emitted(new[:, None], jnp.ones_like(new), failed,
                                                logits[:, None], want_logprobs, prompt,
                                                expert_tokens)

  raw = lm_logits(params, config, spec.gather_rows(hidden, base, num_draft + 1))
  verified = jnp.arange(num_draft + 1)[None, :] <= batch.num_draft[:, None]  # [B, J+1]
  failed = jnp.any(verified & ~jnp.all(jnp.isfinite(raw), axis=-1), axis=1)
  logits = spec.target_logits_for_accept(apply_token_mask(raw, token_mask), batch.sampling,
                                         use_filter=True)  # [B, J+1, V]
  draft_probs = None if host_drafts else state.draft_probs[batch.slot_ids, :num_draft]
  emitted, accepted = spec.accept(logits, pending, draft_probs, batch.num_draft,
                                  batch.sampling, first, backend)
  cache = cache.keep_accepted(batch, accepted)  # a recurrent state forgets rejected drafts
  if host_drafts:
    return state.replace(cache=cache), _emitted(emitted, accepted + 1, failed, raw,
                                                want_logprobs, prompt, expert_tokens)
  last = base + accepted  # [B] column whose logits emitted the last token
  last_token = jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0]
  following = jnp.where(batch.next_tokens >= 0, batch.next_tokens, last_token)
  if draft_config is not None:
    draft_cache, drafts, probs = spec.model_draft(draft_params, draft_config, state.draft_cache,
                                                  batch, last, following, backend, num_draft)
    state = state.replace(cache=cache, draft_cache=draft_cache)
  else:
    t = batch.tokens.shape[1]
    shifted = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], axis=1)  # x_{t+1}
    at_last = jnp.arange(t)[None, :] == last[:, None]
    next_tokens = jnp.where(at_last, following[:, None], shifted)  # [B, T]
    cache, drafts, probs = spec.mtp_draft(params, config, cache, batch, hidden, next_tokens,
                                          last, backend, num_draft)
    state = state.replace(cache=cache)
  state = state.replace(drafts=state.drafts.at[batch.slot_ids, :num_draft].set(drafts),
                        draft_probs=state.draft_probs.at[batch.slot_ids, :num_draft].set(probs))
  return state, _emitted(emitted, accepted + 1, failed, raw, want_logprobs, prompt,
                         expert_tokens)


_STATIC = ("config", "draft_config", "backend", "num_draft", "host_drafts")
serve_step = jit_step(_serve_rows, batch_argnum=3, static_argnames=_STATIC + ("score_prompt",),
                      donate_argnames=("state",))


def _empty_history(u: int, b: int, t: int, config: ModelConfig) -> Emitted:
  """U steps of Emitted for B rows of T columns, nothing emitted yet."""
  a = min(MAX_LOGPROBS, config.vocab_size)
  expert_tokens = None
  if config.num_experts:
    expert_tokens = jnp.zeros((u, config.num_layers, config.num_experts), jnp.int32)
  return Emitted(tokens=jnp.full((u, b, t), -1, jnp.int32), counts=jnp.zeros((u, b), jnp.int32),
                 failed=jnp.zeros((u, b), bool), logprobs=jnp.zeros((u, b, t), jnp.float32),
                 top_ids=jnp.zeros((u, b, t, a), jnp.int32),
                 top_logprobs=jnp.zeros((u, b, t, a), jnp.float32), expert_tokens=expert_tokens)


@jit_step(static_argnames=_STATIC + ("max_steps",), donate_argnames=("state",))
def serve_burst(params: Params, draft_params: Optional[Params], state: EngineState,
                batch: StepBatch, left: jax.Array, stop_ids: jax.Array, num_steps: jax.Array,
                want_logprobs: jax.Array = False, *, config: ModelConfig,
                draft_config: Optional[ModelConfig], backend, num_draft: int, max_steps: int,
                host_drafts: bool = False):
  """Up to num_steps decode steps of one row group in one device loop (multi-step).

  batch: the first step's decode rows ([B, 1 + J]); each later step feeds a
  row's last emitted token at its new position.  Row b runs until it has
  emitted left[b] tokens or one of stop_ids[b] ([B, E], -1 padded), then
  becomes a padding row; the loop ends early once no row runs.  Drafts per
  step are min(J, tokens still allowed - 1), as the scheduler plans a single
  step.  A row whose logits go non-finite stops there (counts 0 from that
  step).  Rows' logit processing (penalties' counts, min_tokens) advances with
  every step's emitted ids (kvjax/runtime/logit_processors.py).  -> (state, Emitted
  stacked over steps ([U, B, ...]; counts 0 once a row stopped), drafted [U, B],
  steps run), U = max_steps.  Drafts come from the
  device: host drafts (n-gram) with num_draft > 0 are refused, since every later
  step would verify the first step's columns again.
  """
  if host_drafts and num_draft:
    raise ValueError(f"serve_burst drafts on the device; host drafts (n-gram) verify in "
                     f"single steps, got num_draft={num_draft}")
  b, t = batch.tokens.shape
  scratch = state.drafts.shape[0] - 1  # the padding rows' slot
  col = jnp.arange(t)[None, :]

  def cond(carry):
    step, active = carry[0], carry[4]
    return (step < num_steps) & jnp.any(active)

  def body(carry):
    step, state, last, starts, active, left, history, drafted_all, processing = carry
    # Step 0 verifies what the host packed (a slot may hold fewer fresh drafts).
    most = jnp.where(step == 0, batch.num_draft, num_draft)
    drafted = jnp.where(active, jnp.maximum(jnp.minimum(most, left - 1), 0), 0)
    step_batch = batch.at_starts(starts, jnp.where(active, 1 + drafted, 0)).replace(
        tokens=batch.tokens.at[:, 0].set(last), num_draft=drafted,
        slot_ids=jnp.where(active, batch.slot_ids, scratch),
        block_tables=jnp.where(active[:, None], batch.block_tables, 0),
        group_tables=None if batch.group_tables is None else tuple(
            jnp.where(active[:, None], table, 0) for table in batch.group_tables),
        sampling=batch.sampling.replace(processing=processing))
    state, out = _serve_rows(
        params, draft_params, state, step_batch, want_logprobs=want_logprobs, config=config,
        draft_config=draft_config, backend=backend, num_draft=num_draft)
    failed = active & out.failed
    counts = jnp.where(active, out.counts, 0)
    emitted = jnp.where(col < counts[:, None], out.tokens, -1)
    out = out.replace(tokens=emitted, counts=counts, failed=failed)
    stopped = jnp.any((emitted[:, :, None] == stop_ids[:, None, :]) & (emitted >= 0)[..., None],
                      axis=(1, 2))
    left = left - counts
    last = jnp.take_along_axis(emitted, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    return (step + 1, state, jnp.where(active, last, batch.tokens[:, 0]), starts + counts,
            active & ~stopped & ~failed & (left > 0), left,
            jax.tree.map(lambda h, x: h.at[step].set(x), history, out),
            drafted_all.at[step].set(drafted),
            None if processing is None else processing.advance(emitted))  # penalties' counts

  history = _empty_history(max_steps, b, t, config)
  # The rows' K/V gathered once, not per step (where the backend allows): the trunk's, and
  # the MTP modules' only if the loop drafts (a draft model keeps its own cache).
  drafting = num_draft and draft_config is None
  loop_cache, settle = decode_loop_cache(state.cache, batch.block_tables, backend,
                                         None if drafting else config.cache_layers(False))
  carry = (jnp.int32(0), state.replace(cache=loop_cache), batch.tokens[:, 0], batch.starts,
           (batch.q_lens > 0) & (left > 0), left, history, jnp.zeros((max_steps, b), jnp.int32),
           batch.sampling.processing)
  steps_run, state, _, ends, *_, history, drafted, _ = jax.lax.while_loop(cond, body, carry)
  state = state.replace(cache=settle(state.cache, batch.starts, ends, max_steps * t))
  return state, history, drafted, steps_run


def num_compiled() -> int:
  """Step programs compiled so far (serve steps and bursts): a step that raised it
  compiled, so its wall time is not the program's."""
  return serve_step._cache_size() + serve_burst._cache_size()


@functools.partial(jax.jit, donate_argnames=("state",))
def copy_pages(state: EngineState, src: jax.Array, dst: jax.Array) -> EngineState:
  """Copy pages src [copies] -> dst [copies] in every cache layer (token-mode prefix hits).

  Every per-page array moves (quantized caches' scales too; kvjax/caches/paged.py).
  """
  state = state.replace(cache=copy_cache_pages(state.cache, src, dst))
  if state.draft_cache is not None:
    state = state.replace(draft_cache=copy_cache_pages(state.draft_cache, src, dst))
  return state


@functools.partial(jax.jit, donate_argnames=("state",))
def clear_pages(state: EngineState, pages: tuple, slots: jax.Array) -> EngineState:
  """Zero pages (one array of page ids per KV layer group's pool, or one for the one pool)
  and slots [slots] in every cache (a failed request's; see kvjax/caches/paged.py
  clear_cache_pages) and the slots' pending drafts."""
  cache = state.cache
  cache = (cache.cleared(pages, slots) if isinstance(cache, GroupedKVCache)
           else clear_cache_pages(cache, pages[0], slots))
  state = state.replace(cache=cache,
                        drafts=state.drafts.at[slots].set(0),
                        draft_probs=state.draft_probs.at[slots].set(0))
  if state.draft_cache is not None:
    state = state.replace(draft_cache=clear_cache_pages(state.draft_cache, pages[0], slots))
  return state
