"""Engine: continuous batching over the pure steps, prefix caching, speculative decoding.

The host loop per `step()`:
  1. `Scheduler.schedule()` picks rows (decodes first, then prefill chunks),
     slots and pages (kvjax/scheduler.py owns every policy decision);
  2. token-mode prefix hits are page copies, applied first (`copy_pages`);
  3. decode rows and prefill rows run as two calls of one jitted `serve_step`
     (state donated, config static); splitting them keeps a 1-token decode row
     from being padded to a 256-token prefill chunk.  A multi-step plan (decode
     rows only) runs `serve_burst`: a device loop of serve_step's body that
     feeds each step's emitted tokens to the next;
  4. one host sync reads the emitted ids, `update_from_output` appends them,
     applies stops and frees pages.
`serve_step` overwrites each row's block table and length in the device state
from the plan, so preemption, abort and rejected drafts need no device
rollback.  Shapes are bucketed to powers of two (rows from min(8,
max_num_seqs) up to max_num_seqs, fewer for long prefill chunks; prefill
chunks from 16 up to the token budget; decode rows are always 1 + K wide;
block tables from 8 pages up to the widest a row can need), so a run compiles
at most (row buckets) x (chunk buckets + 1) x (table buckets) steps, plus a
multi-step decode loop per row and table bucket.  The table width matters
because the reference backend gathers every column: a decode row of a 192-token context
would otherwise carry the 32 extra pages a 512-token prefill chunk needs.

Sampling matches kvjax.generate: the token at sequence index p of a request
is drawn with fold_in(PRNGKey(seed), p), so greedy and sampled outputs do not
depend on batching, chunking or preemption (with speculation, greedy only;
see kvjax/speculative.py).  Padding rows use a scratch slot and the null page.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import speculative as spec
from kvjax.attention.registry import get_backend
from kvjax.cache import PagedKVCache, copy_cache_pages
from kvjax.config import ModelConfig
from kvjax.generation import GenerateResult, validate_prompts
from kvjax.metrics import RequestMetrics, StepLog, summarize
from kvjax.model import lm_logits
from kvjax.params import Params
from kvjax.quant.kv import check_kv_dtype
from kvjax.sampling import SamplingParams, sample
from kvjax.scheduler import Scheduler, SchedulerOutput, bucket, max_pages_held
from kvjax.steps import DecodeState, init_paged_state, model_step
from kvjax.xla_options import jit_step

__all__ = ["Engine", "EngineState", "RowBatch", "RequestOutput", "serve_step", "serve_burst",
           "copy_pages"]

# Fewest padded rows and shortest padded prefill chunk: fewer shapes to compile.
# Prefill groups of long chunks pad fewer rows: at most _MIN_PREFILL_TOKENS of
# padding-only rows (4 rows of 128-token chunks run as 4, not 8).
_MIN_ROWS_BUCKET = 8
_MIN_PREFILL_BUCKET = 16
_MIN_PREFILL_TOKENS = 128
_MIN_TABLE_BUCKET = 8  # pages


@struct.dataclass
class EngineState:
  decode: DecodeState  # paged KV (trunk + MTP layers), block tables, lengths per slot
  drafts: jax.Array  # [slots, K] int32 drafts each slot feeds at its next verify
  draft_probs: jax.Array  # [slots, K, V] f32 draft distributions (C10's p_draft)
  draft_cache: Optional[PagedKVCache] = None  # a draft model's KV, same pages and tables


@struct.dataclass
class RowBatch:
  """One group of scheduled rows, padded to bucketed [B, T]."""

  tokens: jax.Array  # [B, T] int32 known ids; draft columns are filled on device
  q_lens: jax.Array  # [B] int32 positions written (0 = padding row)
  num_draft: jax.Array  # [B] int32 trailing draft columns
  slot_ids: jax.Array  # [B] int32 state slot (padding rows: the scratch slot)
  starts: jax.Array  # [B] int32 position of column 0 (= tokens already cached)
  next_tokens: jax.Array  # [B] int32 id after a mid-prompt chunk, -1 if the row samples
  block_tables: jax.Array  # [B, W'] int32 page ids, null-page padded, W' <= state's W


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  """What a step produced for one request (the streaming unit)."""

  request_id: str
  new_token_ids: list  # ids appended this step
  output_ids: list  # every id generated so far
  finished: bool
  finish_reason: Optional[str]  # "stop" | "length" | "abort" once finished
  metrics: Optional[RequestMetrics] = None  # the request's timeline, once finished


def _serve_rows(params: Params, draft_params: Optional[Params], state: EngineState,
                rows: RowBatch, sampling: SamplingParams, *, config: ModelConfig,
                draft_config: Optional[ModelConfig], backend: str, num_draft: int,
                use_filter: bool):
  """Run one row group -> (state, emitted [B, K+1] int32 padded -1, num_emitted [B]).

  num_draft = 0: plain decoding, one token per row sampled as kvjax.generate does.
  num_draft = K: rows verify their drafts (C9-C10) and every row drafts anew, with
  the MTP modules (draft_config None) or the draft model.
  """
  width = state.decode.block_tables.shape[1]
  tables = jnp.zeros((rows.slot_ids.shape[0], width), jnp.int32)
  tables = state.decode.block_tables.at[rows.slot_ids].set(
      tables.at[:, :rows.block_tables.shape[1]].set(rows.block_tables))
  decode = state.decode.replace(  # the step reads only the rows' bucketed table width
      block_tables=tables[:, :rows.block_tables.shape[1]],
      seq_lens=state.decode.seq_lens.at[rows.slot_ids].set(rows.starts))
  tokens = rows.tokens
  if num_draft:
    tokens = spec.fill_drafts(tokens, state.drafts[rows.slot_ids], rows.num_draft)
  decode, hidden = model_step(params, decode, tokens, rows.q_lens, rows.slot_ids,
                              config=config, backend=backend)  # hidden [B, T, D]
  decode = decode.replace(block_tables=tables)
  base = jnp.maximum(rows.q_lens - 1 - rows.num_draft, 0)  # column of the last known token
  first = rows.starts + base + 1  # sequence index of the first emitted token
  if not num_draft:
    logits = lm_logits(params, config, spec.gather_rows(hidden, base, 1)[:, 0])
    new = sample(logits, sampling, first, use_filter=use_filter)  # [B]
    return state.replace(decode=decode), new[:, None], jnp.ones_like(new)

  logits = lm_logits(params, config, spec.gather_rows(hidden, base, num_draft + 1))
  logits = spec.target_logits_for_accept(logits, sampling, use_filter)  # [B, K+1, V]
  emitted, accepted = spec.accept(logits, state.drafts[rows.slot_ids],
                                  state.draft_probs[rows.slot_ids], rows.num_draft, sampling,
                                  first)
  last = base + accepted  # [B] column whose logits emitted the last token
  last_token = jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0]
  following = jnp.where(rows.next_tokens >= 0, rows.next_tokens, last_token)
  if draft_config is not None:
    draft_cache, drafts, probs = spec.model_draft(
        draft_params, draft_config, state.draft_cache, tokens, rows.slot_ids, rows.starts,
        rows.q_lens, rows.block_tables, last, following, sampling, backend, num_draft)
    state = state.replace(decode=decode, draft_cache=draft_cache)
  else:
    t = tokens.shape[1]
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)  # x_{t+1}
    at_last = jnp.arange(t)[None, :] == last[:, None]
    next_tokens = jnp.where(at_last, following[:, None], shifted)  # [B, T]
    batch, attend = spec.paged_attend(rows.slot_ids, rows.starts, rows.q_lens,
                                      rows.block_tables, t, config, backend)
    cache, drafts, probs = spec.mtp_draft(params, config, decode.cache, batch, hidden,
                                          next_tokens, last, sampling, attend, num_draft)
    state = state.replace(decode=decode.replace(cache=cache))
  state = state.replace(drafts=state.drafts.at[rows.slot_ids].set(drafts),
                        draft_probs=state.draft_probs.at[rows.slot_ids].set(probs))
  return state, emitted, accepted + 1


_STATIC = ("config", "draft_config", "backend", "num_draft", "use_filter")
serve_step = jit_step(_serve_rows, static_argnames=_STATIC, donate_argnames=("state",))


@jit_step(static_argnames=_STATIC + ("max_steps",), donate_argnames=("state",))
def serve_burst(params: Params, draft_params: Optional[Params], state: EngineState,
                rows: RowBatch, sampling: SamplingParams, left: jax.Array,
                stop_ids: jax.Array, num_steps: jax.Array, *, config: ModelConfig,
                draft_config: Optional[ModelConfig], backend: str, num_draft: int,
                use_filter: bool, max_steps: int):
  """Up to num_steps decode steps of one row group in one device loop (multi-step).

  rows: the first step's decode rows ([B, 1 + K]); each later step feeds a
  row's last emitted token at its new length.  Row b runs until it has emitted
  left[b] tokens or one of stop_ids[b] ([B, S], -1 padded), then becomes a
  padding row; the loop ends early once no row runs.  Drafts per step are
  min(K, tokens still allowed - 1), as the scheduler plans a single step.
  -> (state, emitted [max_steps, B, K+1] (-1 padded), counts [max_steps, B]
  (0 once a row stopped), drafted [max_steps, B], steps run).
  """
  b, t = rows.tokens.shape
  scratch = state.drafts.shape[0] - 1  # the padding rows' slot
  col = jnp.arange(t)[None, :]

  def cond(carry):
    step, active = carry[0], carry[4]
    return (step < num_steps) & jnp.any(active)

  def body(carry):
    step, state, last, starts, active, left, emitted_all, counts_all, drafted_all = carry
    drafted = jnp.where(active, jnp.maximum(jnp.minimum(num_draft, left - 1), 0), 0)
    step_rows = rows.replace(
        tokens=rows.tokens.at[:, 0].set(last), q_lens=jnp.where(active, 1 + drafted, 0),
        num_draft=drafted, slot_ids=jnp.where(active, rows.slot_ids, scratch), starts=starts,
        block_tables=jnp.where(active[:, None], rows.block_tables, 0))
    state, emitted, counts = _serve_rows(
        params, draft_params, state, step_rows, sampling, config=config,
        draft_config=draft_config, backend=backend, num_draft=num_draft,
        use_filter=use_filter)
    counts = jnp.where(active, counts, 0)
    emitted = jnp.where(col < counts[:, None], emitted, -1)
    stopped = jnp.any((emitted[:, :, None] == stop_ids[:, None, :]) & (emitted >= 0)[..., None],
                      axis=(1, 2))
    left = left - counts
    last = jnp.take_along_axis(emitted, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    return (step + 1, state, jnp.where(active, last, rows.tokens[:, 0]), starts + counts,
            active & ~stopped & (left > 0), left, emitted_all.at[step].set(emitted),
            counts_all.at[step].set(counts), drafted_all.at[step].set(drafted))

  carry = (jnp.int32(0), state, rows.tokens[:, 0], rows.starts, (rows.q_lens > 0) & (left > 0),
           left, jnp.full((max_steps, b, t), -1, jnp.int32),
           jnp.zeros((max_steps, b), jnp.int32), jnp.zeros((max_steps, b), jnp.int32))
  steps_run, state, *_, emitted, counts, drafted = jax.lax.while_loop(cond, body, carry)
  return state, emitted, counts, drafted, steps_run


@functools.partial(jax.jit, donate_argnames=("state",))
def copy_pages(state: EngineState, src: jax.Array, dst: jax.Array) -> EngineState:
  """Copy pages src [C] -> dst [C] in every cache layer (token-mode prefix hits).

  Every per-page array moves (quantized caches' scales too; kvjax/cache.py).
  """
  cache = copy_cache_pages(state.decode.cache, src, dst)
  state = state.replace(decode=state.decode.replace(cache=cache))
  if state.draft_cache is not None:
    state = state.replace(draft_cache=copy_cache_pages(state.draft_cache, src, dst))
  return state


def _widest_window(cfg: ModelConfig, draft: Optional[ModelConfig]) -> Optional[int]:
  """Widest window over every layer reading the pages; None if one sees everything."""
  windows = [cfg.kv_window] + ([draft.kv_window] if draft is not None else [])
  return None if None in windows else max(windows)


def _check_int4(kv_dtype: Optional[str], speculative, token_prefix_hits: bool) -> None:
  """ValueError for what int4 (KIVI) pages cannot serve; see Engine's kv_dtype."""
  if kv_dtype != "int4":
    return
  if speculative is not None:
    drafter = speculative if isinstance(speculative, str) else "a draft model"
    raise ValueError(f"kv_dtype 'int4' cannot verify drafts (speculative={drafter!r}): a "
                     "rejected draft that completed a page leaves the slot's full-precision "
                     "residual holding the wrong page; use kv_dtype='int8' or no speculation")
  if token_prefix_hits:
    raise ValueError("kv_dtype 'int4' cannot reuse partial pages (prefix_match='token'): a "
                     "resumed page's leading tokens must sit in the slot's full-precision "
                     "residual, not in a copied, already-quantized page; use "
                     "prefix_match='block' or prefix_cache=False")


@dataclasses.dataclass(frozen=True)
class _Sampling:
  temperature: float
  top_k: int
  top_p: float
  seed: int


class Engine:
  """Continuous-batching inference engine over one model.

  Args:
    model: a kvjax.Model.
    page_size: tokens per KV page.
    num_pages: KV pages in the pool, null page included (default: every slot
      can hold the most pages a max_model_len request holds at once, fewer
      than it spans when every layer has a sliding window).
    max_num_seqs: running requests (rows) at most.
    max_num_batched_tokens: token budget per step (draft slots included).
    max_model_len: prompt + max_new_tokens cap (default: the model context).
    prefix_cache: share computed full blocks across requests (C8).
    prefix_match: "block" (vLLM) or "token" (also a partial last block).
    min_cacheable_tokens: shorter prefix hits are ignored.
    speculative: None, "mtp" (draft with the model's MTP modules) or a kvjax.Model
      of the same vocabulary (a separate draft model with its own paged KV).
    num_draft: draft tokens per verify step (K).
    backend: attention backend name (kvjax/attention/registry.py).
    num_scheduler_steps: most decode steps one device call runs (multi-step
      scheduling, kvjax/scheduler.py): when every running request decodes and
      nothing could be admitted meanwhile, the emitted tokens feed the next
      step on device, so host scheduling and dispatch are paid once per burst.
      Outputs do not change; a burst's tokens stream out together.  1: one
      step per call.
    kv_dtype: how pages store K/V: None (the model dtype), "fp32", "bf16",
      "fp16", "int8" or "int4" (kvjax/quant/kv.py).  int4 (KIVI) keeps each
      slot's incomplete page in a per-slot full-precision residual, not in the
      pool, so it refuses what would resume a slot mid-page on stale residual
      data: token-mode prefix hits (the copied page's leading tokens would have
      to be in the residual) and speculative decoding (a rejected draft that
      completed a page leaves the residual holding the next page).  Its
      outputs also depend on chunking (a query reads its own incomplete page
      in full precision), so they match the static batch only for unchunked
      prompts; int8 matches it always.
  The engine keeps its pages and prefix cache across `generate` calls, and
  forgets a request once its final RequestOutput (which carries its metrics)
  has been returned, so a long-running engine holds no per-request history.  When
  every layer (MTP modules and a draft model too) has a sliding window, pages
  behind a request's window return to the pool as it runs (kvjax/scheduler.py).
  """

  def __init__(self, model, *, page_size: int = 16, num_pages: Optional[int] = None,
               max_num_seqs: int = 8, max_num_batched_tokens: int = 512,
               max_model_len: Optional[int] = None, prefix_cache: bool = True,
               prefix_match: str = "block", min_cacheable_tokens: int = 0,
               speculative=None, num_draft: int = 2, backend: str = "reference",
               num_scheduler_steps: int = 16, kv_dtype: Optional[str] = None):
    cfg = model.config
    get_backend(backend)  # ValueError naming an unknown backend
    check_kv_dtype(kv_dtype, cfg, "paged", backend)
    _check_int4(kv_dtype, speculative, prefix_cache and prefix_match == "token")
    self.draft_model = None if isinstance(speculative, (str, type(None))) else speculative
    if self.draft_model is not None:
      if not (hasattr(speculative, "config") and hasattr(speculative, "params")):
        raise ValueError(f"speculative must be None, 'mtp' or a kvjax.Model, got "
                         f"{type(speculative).__name__}")
      spec.check_draft_model(cfg, self.draft_model.config, num_draft)
    elif speculative not in (None, "mtp"):
      raise ValueError(f"speculative must be None, 'mtp' or a kvjax.Model, got {speculative!r}")
    elif speculative:
      spec.check_mtp(cfg, model.params, num_draft)
    max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
    if not 1 <= max_model_len <= cfg.max_position_embeddings:
      raise ValueError(f"max_model_len must be in [1, {cfg.max_position_embeddings}] "
                       f"(the model context), got {max_model_len}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    window = _widest_window(cfg, self.draft_model and self.draft_model.config)
    if num_pages is None:  # a windowed model's requests hold a bounded number of pages
      num_pages = 1 + max_num_seqs * max_pages_held(
          max_model_len, page_size=page_size, max_num_batched_tokens=max_num_batched_tokens,
          sliding_window=window)
    self.model = model
    self.config = cfg
    self.backend = backend
    self.kv_dtype = kv_dtype
    self.num_draft = num_draft if speculative else 0
    self.scheduler = Scheduler(
        num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_prefix_caching=prefix_cache, prefix_match=prefix_match,
        min_cacheable_tokens=min_cacheable_tokens, num_lookahead_slots=self.num_draft,
        num_scheduler_steps=num_scheduler_steps, eos_token_id=cfg.eos_token_id,
        sliding_window=window)
    self.max_num_seqs = max_num_seqs
    self._max_query = bucket(max_num_batched_tokens)
    # Block tables cover a padded row's last position too (kvjax/steps.py).
    width = self.scheduler.max_pages_per_seq + -(-self._max_query // page_size)
    decode = init_paged_state(cfg, max_num_seqs + 1, num_pages, page_size, width, model.dtype,
                              kv_dtype, with_mtp=speculative == "mtp")
    k = self.num_draft
    draft_cache = None
    if self.draft_model is not None:
      d = self.draft_model.config
      draft_cache = PagedKVCache.create(d.num_layers, d.num_kv_heads, num_pages, page_size,
                                        d.head_dim, self.draft_model.dtype)
    self.state = EngineState(decode=decode,
                             drafts=jnp.zeros((max_num_seqs + 1, k), jnp.int32),
                             draft_probs=jnp.zeros((max_num_seqs + 1, k, cfg.vocab_size),
                                                   jnp.float32),
                             draft_cache=draft_cache)
    self._ids = itertools.count()
    self.metrics: dict[str, RequestMetrics] = {}  # unfinished requests only
    self._pending: list[RequestOutput] = []  # returned by the next step()
    self.steps = StepLog()

  # -- requests ---------------------------------------------------------------

  def add_request(self, prompt: Sequence[int], max_new_tokens: int, *,
                  temperature: float = 0.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, seed: Optional[int] = None,
                  stop: Union[None, int, Sequence[int]] = None,
                  cache_salt: Optional[str] = None) -> str:
    """Queue one request -> its id.  ValueError (nothing queued) on bad input.

    `stop`: token id(s) that end the request (kept as its last output id), in
    addition to the model's EOS.  `cache_salt` isolates a tenant's prefix
    blocks from everyone else's.
    """
    request_id = str(next(self._ids))
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"request {request_id!r}: prompt must be a non-empty 1-D list of "
                       f"int token ids, got shape {ids.shape} dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
    if bad.size:
      raise ValueError(f"request {request_id!r}: token id {int(bad[0])} outside [0, "
                       f"vocab_size={self.config.vocab_size})")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
      raise ValueError(f"request {request_id!r}: max_new_tokens must be a positive int, "
                       f"got {max_new_tokens!r}")
    if temperature < 0 or (top_k is not None and top_k < 0) or (
        top_p is not None and not 0 < top_p <= 1):
      raise ValueError(f"request {request_id!r}: need temperature >= 0, top_k >= 0, "
                       f"0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    stops = () if stop is None else (stop,) if isinstance(stop, (int, np.integer)) else stop
    sampling = _Sampling(float(temperature), int(top_k or 0),
                         1.0 if top_p is None else float(top_p),
                         0 if seed is None else int(seed))
    self.scheduler.add_request(request_id, ids.tolist(), int(max_new_tokens),
                               stop_token_ids=[int(s) for s in stops],
                               cache_salt=cache_salt, sampling=sampling)
    self.metrics[request_id] = RequestMetrics(request_id, int(ids.size), time.perf_counter())
    return request_id

  def abort(self, request_id: str) -> bool:
    """Finish a waiting or running request now; its pages are freed.

    Its final RequestOutput (finish_reason "abort") comes with the next step().
    """
    req = self.scheduler.requests.get(request_id)
    if req is None or not self.scheduler.abort(request_id):
      return False
    metrics = self.metrics.pop(request_id)
    metrics.finish_s = time.perf_counter()
    self._pending.append(RequestOutput(request_id, [], list(req.output_ids), True,
                                       req.status.value, metrics))
    return True

  @property
  def has_unfinished(self) -> bool:
    """Requests still running or waiting, or final outputs not yet returned."""
    return self.scheduler.has_unfinished or bool(self._pending)

  # -- stepping ---------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Run one scheduled step -> outputs of the requests that got tokens.

    Also returns outputs held back since the last step (aborts, and other
    requests' outputs produced while `generate` ran).
    """
    start = time.perf_counter()
    outputs, self._pending = self._pending, []
    plan = self.scheduler.schedule()
    waiting = len(self.scheduler.waiting)
    if not plan.rows and waiting and not self.scheduler.running and not plan.preempted_ids:
      # Every waiting request fits an idle pool (add_request checks): a bug, not a wait.
      raise RuntimeError(f"the scheduler admitted none of {waiting} waiting requests into "
                         f"an idle pool of {self.scheduler.allocator.num_usable} pages")
    if plan.copies:
      # At most one copy per admitted row: pad to max_num_seqs, one shape.
      src, dst = (np.zeros(self.max_num_seqs, np.int32) for _ in range(2))
      src[:len(plan.copies)] = [cp.src for cp in plan.copies]
      dst[:len(plan.copies)] = [cp.dst for cp in plan.copies]
      self.state = copy_pages(self.state, src, dst)
    groups = [[i for i, r in enumerate(plan.rows) if r.is_decode == decode]
              for decode in (True, False)]
    launched = [(group, self._launch(plan, group)) for group in groups if group]
    new_ids, verified = {}, []
    steps_run = 1
    for group, (emitted, counts, drafted, steps) in launched:
      # emitted [S, B, K+1], counts and drafted [S, B]: S = 1 but for a burst (which is
      # the plan's only group).  np.asarray is the step's host sync.
      emitted, counts, drafted = np.asarray(emitted), np.asarray(counts), np.asarray(drafted)
      steps_run = int(steps)
      for j, i in enumerate(group):
        row = plan.rows[i]
        if row.start == row.request.num_cached_tokens and not row.is_decode:
          metrics = self.metrics[row.request_id]
          metrics.prefix_hit_tokens = row.request.num_cached_tokens
        if row.sample:
          new_ids[row.request_id] = [t for s in range(steps_run)
                                     for t in emitted[s, j, :counts[s, j]].tolist()]
          verified += [(row.request_id, int(drafted[s, j]), int(counts[s, j]) - 1)
                       for s in range(steps_run) if drafted[s, j]]
    before = {rid: self.scheduler.requests[rid].num_output_tokens for rid in new_ids}
    sampled = {rid: self.scheduler.requests[rid] for rid in new_ids}
    self.scheduler.update_from_output(plan, new_ids)
    now = time.perf_counter()
    for rid, num_draft, num_accepted in verified:
      self.metrics[rid].record_verify(num_draft, num_accepted, self.num_draft)
    for rid, req in sampled.items():
      new = req.output_ids[before[rid]:]
      metrics = self.metrics[rid]
      metrics.record_tokens(len(new), now)
      metrics.num_preemptions = req.num_preemptions
      finished = req.status.is_finished
      if finished:
        metrics.finish_s = now
        del self.metrics[rid]
      outputs.append(RequestOutput(rid, new, list(req.output_ids), finished,
                                   req.status.value if finished else None,
                                   metrics if finished else None))
    allocator = self.scheduler.allocator
    self.steps.record(waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
                      utilization=allocator.utilization, pages_used=allocator.num_used,
                      batched_tokens=plan.num_batched_tokens, step_s=now - start,
                      decode_only=bool(plan.rows) and all(r.is_decode for r in plan.rows),
                      num_steps=steps_run)
    return outputs

  def stream(self) -> Iterator[RequestOutput]:
    """Step until every request finishes, yielding each step's outputs."""
    while self.has_unfinished:
      yield from self.step()

  __iter__ = stream

  def _launch(self, plan: SchedulerOutput, group: list[int]):
    """Pad one row group to its bucket and dispatch serve_step or serve_burst (no host sync).

    -> (emitted [S, B, K+1], counts [S, B], drafted [S, B], steps run), S = 1
    unless the plan is a burst.
    """
    rows = [plan.rows[i] for i in group]
    min_rows = _MIN_ROWS_BUCKET
    if rows[0].is_decode:
      t = 1 + self.num_draft  # one shape whatever drafts the budget allowed
    else:
      t = bucket(max(r.num_tokens for r in rows), self._max_query,
                 min(_MIN_PREFILL_BUCKET, self._max_query))
      min_rows = max(1, min(min_rows, _MIN_PREFILL_TOKENS // t))
    b = bucket(len(rows), self.max_num_seqs, min(min_rows, self.max_num_seqs))
    # A burst's table covers every position reserved (start + num_tokens).
    width = self._table_width(plan.block_tables[group], rows, t)
    tokens = np.zeros((b, t), np.int32)
    q_lens, num_draft, starts = (np.zeros(b, np.int32) for _ in range(3))
    slot_ids = np.full(b, self.max_num_seqs, np.int32)  # padding: the scratch slot
    next_tokens = np.full(b, -1, np.int32)
    tables = np.zeros((b, width), np.int32)
    held = plan.block_tables[group][:, :width]
    tables[:len(rows), :held.shape[1]] = held
    temperature, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
    top_k, seeds = np.zeros(b, np.int32), np.zeros(b, np.uint32)
    for j, row in enumerate(rows):
      tokens[j, :len(row.token_ids)] = row.token_ids
      q_lens[j], num_draft[j], slot_ids[j], starts[j] = (
          len(row.token_ids) + row.num_draft, row.num_draft, row.slot, row.start)
      if not row.sample:
        next_tokens[j] = row.request.token_ids[row.start + row.num_tokens]
      s = row.request.sampling
      temperature[j], top_k[j], top_p[j], seeds[j] = s.temperature, s.top_k, s.top_p, s.seed
    batch = RowBatch(tokens=tokens, q_lens=q_lens, num_draft=num_draft, slot_ids=slot_ids,
                     starts=starts, next_tokens=next_tokens, block_tables=tables)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds)
    use_filter = bool((top_k > 0).any() or (top_p < 1).any())
    draft = self.draft_model
    static = dict(config=self.config, draft_config=draft and draft.config,
                  backend=self.backend, num_draft=self.num_draft, use_filter=use_filter)
    if plan.num_steps == 1:
      self.state, emitted, counts = serve_step(
          self.model.params, draft and draft.params, self.state, batch, sampling, **static)
      return emitted[None], counts[None], num_draft[None], 1
    left = np.zeros(b, np.int32)
    stops = [sorted(r.request.stop_token_ids) for r in rows]
    stop_ids = np.full((b, bucket(max(map(len, stops)))), -1, np.int32)
    for j, (row, ids) in enumerate(zip(rows, stops)):
      left[j] = row.request.max_new_tokens - row.request.num_output_tokens
      stop_ids[j, :len(ids)] = ids
    self.state, emitted, counts, drafted, steps = serve_burst(
        self.model.params, draft and draft.params, self.state, batch, sampling, left, stop_ids,
        np.int32(plan.num_steps), max_steps=self.scheduler.num_scheduler_steps, **static)
    return emitted, counts, drafted, steps

  def _table_width(self, tables: np.ndarray, rows, t: int) -> int:
    """Block-table columns a row group's step reads, bucketed (fewer compiled shapes).

    The reference backend gathers every column, so a decode group (rows 1 + K
    wide) should not carry the columns a max_num_batched_tokens prefill row
    needs: cover each row's padded last position start + t - 1 and every page
    it holds, in powers of two from _MIN_TABLE_BUCKET pages.
    """
    full = self.state.decode.block_tables.shape[1]
    g = self.scheduler.page_size
    needed = max(-(-(r.start + t) // g) for r in rows)
    held = np.flatnonzero(tables.any(axis=0))
    needed = max(needed, int(held[-1]) + 1 if held.size else 0)
    return bucket(needed, full, min(_MIN_TABLE_BUCKET, full))

  # -- one-shot ---------------------------------------------------------------

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
               temperature: float = 0.0, top_k: Optional[int] = None,
               top_p: Optional[float] = None, seed: Union[int, Sequence[int]] = 0,
               stop: Union[None, int, Sequence[int]] = None,
               cache_salt: Optional[str] = None) -> GenerateResult:
    """Run `prompts` to completion -> GenerateResult(tokens per prompt, stats).

    Every prompt is validated before any is queued, so bad input changes
    nothing.  `seed` is one int or one per prompt.
    """
    prompts = validate_prompts(self.config, prompts, max_new_tokens)
    seeds = [seed] * len(prompts) if isinstance(seed, (int, np.integer)) else list(seed)
    if len(seeds) != len(prompts):
      raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
    usable = self.scheduler.allocator.num_usable
    for i, prompt in enumerate(prompts):
      total = len(prompt) + max_new_tokens
      if total > self.scheduler.max_model_len:
        raise ValueError(f"prompt {i}: length {len(prompt)} + max_new_tokens "
                         f"{max_new_tokens} exceeds max_model_len "
                         f"{self.scheduler.max_model_len}")
      if self.scheduler.max_pages_held(total) > usable:
        raise ValueError(f"prompt {i} needs up to {self.scheduler.max_pages_held(total)} KV "
                         f"pages but the pool has {usable}")
    cache = self.scheduler.prefix_cache
    hits_before = (cache.hit_tokens, cache.queried_tokens) if cache else (0, 0)
    preemptions_before = self.scheduler.num_preemptions
    mark = self.steps.num_recorded
    start = time.perf_counter()
    ids = [self.add_request(p, max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=s, stop=stop, cache_salt=cache_salt)
           for p, s in zip(prompts, seeds)]
    done, others, mine = {}, [], set(ids)
    while len(done) < len(ids):
      for out in self.step():
        if out.request_id not in mine:
          others.append(out)  # another caller's: handed out by the next step()
        elif out.finished:
          done[out.request_id] = out
    wall = time.perf_counter() - start
    hits = (cache.hit_tokens, cache.queried_tokens) if cache else (0, 0)
    steps = self.steps.since(mark)
    self._pending = others + self._pending
    stats = summarize([done[rid].metrics for rid in ids], steps, wall,
                      prefix_hit_tokens=hits[0] - hits_before[0],
                      prefix_queried_tokens=hits[1] - hits_before[1],
                      num_preemptions=self.scheduler.num_preemptions - preemptions_before)
    stats["cache"] = "paged"
    stats["speculative"] = (None if not self.num_draft else "mtp" if self.draft_model is None
                            else self.draft_model.config.name)
    return GenerateResult(tokens=[done[rid].output_ids for rid in ids], stats=stats)
