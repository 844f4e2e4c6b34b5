"""Static-batch generation: prefill every prompt, then a jitted decode loop.

The decode loop is one `lax.while_loop` inside one jit (the JAX analog of a
replayed CUDA graph, claim C13): no Python between tokens.  Shapes are
bucketed to powers of two (batch rows, prompt length, total length, decode
steps), so a run compiles a small, known number of programs.  Three caches,
one contract: "paged" (pages + block tables), "contiguous" (one max-length
buffer per row, claim C7's baseline) and "none" (recompute the whole prefix
every token, claims C2/C17's baseline).  stats["finish_reasons"] says how each
prompt ended: "stop" (EOS), "length", or "error" when the model's logits went
non-finite (NaN or inf) at some position: its tokens end before that one, as
the Engine's do.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention.backends import get_backend, on_mesh
from kvjax.caches import (CACHE_KINDS, check_cache_support, create_contiguous_cache,
                          create_paged_cache)
from kvjax.caches.gathered import decode_loop_cache
from kvjax.model.config import ModelConfig
from kvjax.model.decoder import forward_hidden, lm_logits
from kvjax.model.params import Params
from kvjax.parallel.sharding import mesh_of
from kvjax.runtime.sampling import SamplingParams, sample
from kvjax.runtime.step_batch import StepBatch, make_step_batch
from kvjax.runtime.steps import model_step, prefill
from kvjax.runtime.xla_options import jit_step

__all__ = ["GenerateResult", "generate_static", "validate_prompts", "next_pow2", "CACHE_KINDS"]


@dataclasses.dataclass
class GenerateResult:
  tokens: list  # list[list[int]]: new tokens only, per prompt (EOS included, then stop)
  stats: dict  # timings and counts; "finish_reasons": per prompt


def _nonfinite_rows(logits: jax.Array) -> jax.Array:
  """logits [B, V] -> [B] bool: the rows whose logits hold a NaN or inf."""
  return ~jnp.all(jnp.isfinite(logits), axis=-1)


def next_pow2(n: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def validate_prompts(cfg: ModelConfig, prompts, max_new_tokens) -> list[list[int]]:
  """Normalize prompts to lists of ints; raise ValueError naming any bad value."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) and not (
      isinstance(prompts, np.ndarray)):
    raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
  if len(prompts) == 0:
    raise ValueError("prompts is empty: give at least one prompt")
  if all(isinstance(t, (int, np.integer)) for t in prompts):  # one prompt, not a batch
    shown = [int(t) for t in prompts[:8]]
    raise ValueError(f"prompts must be a list of prompts (lists of token ids), got a flat list "
                     f"of {len(prompts)} ints {shown}{' ...' if len(prompts) > 8 else ''}; "
                     "for one prompt write [ids]")
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
  normalized = []
  for i, prompt in enumerate(prompts):
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0:
      raise ValueError(f"prompt {i} is empty or not 1-D (shape {ids.shape})")
    if not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt {i} has non-integer token ids (dtype {ids.dtype})")
    bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
    if bad.size:
      raise ValueError(f"prompt {i} has token id {int(bad[0])} outside [0, "
                       f"vocab_size={cfg.vocab_size})")
    if ids.size + max_new_tokens > cfg.max_position_embeddings:
      raise ValueError(
          f"prompt {i}: length {ids.size} + max_new_tokens {max_new_tokens} exceeds the "
          f"model context {cfg.max_position_embeddings}")
    normalized.append([int(t) for t in ids])
  return normalized


@jit_step(static_argnames=("config", "backend", "max_steps", "use_filter"),
          donate_argnames=("cache",))
def _decode_loop(params: Params, cache, batch: StepBatch, num_steps: jax.Array,
                 eos_id: jax.Array, *, config: ModelConfig, backend, max_steps: int,
                 use_filter: bool):
  """Feed batch.tokens [B, 1] and sample up to num_steps more -> (cache, out [B, max_steps],
  failed_at [B] int32: the step whose logits went non-finite, max_steps if none).

  batch: one column per row at its first decode position, q_lens 1 for live
  rows (0 for padding); each step moves the live rows one position on (the
  carry owns the lengths).  Stops early once every live row has emitted
  eos_id (-1: never) or failed.
  """
  b = batch.tokens.shape[0]
  live = batch.q_lens > 0

  def cond(carry):
    _, _, _, _, step, done, _ = carry
    return (step < num_steps) & ~jnp.all(done)

  def body(carry):
    cache, tokens, starts, out, step, done, failed_at = carry
    step_batch = batch.at_starts(starts, batch.q_lens).replace(tokens=tokens[:, None])
    cache, hidden = model_step(params, cache, step_batch, config=config, backend=backend)
    logits = lm_logits(params, config, hidden[:, 0])
    starts = starts + batch.q_lens
    new = sample(logits, batch.sampling, starts, use_filter=use_filter)
    out = out.at[:, step].set(new)
    failed = _nonfinite_rows(logits) & ~done
    failed_at = jnp.where(failed, step, failed_at)
    return cache, new, starts, out, step + 1, done | failed | (new == eos_id), failed_at

  tokens = batch.tokens[:, 0]
  out = jnp.full((b, max_steps), -1, jnp.int32)
  done = (tokens == eos_id) | ~live
  # The rows' K/V gathered once, not per step (where the backend allows).
  loop_cache, settle = decode_loop_cache(cache, batch.block_tables, backend)
  carry = (loop_cache, tokens, batch.starts, out, 0, done, jnp.full((b,), max_steps, jnp.int32))
  loop_cache, _, ends, out, _, _, failed_at = jax.lax.while_loop(cond, body, carry)
  return settle(loop_cache, batch.starts, ends, max_steps), out, failed_at


@functools.partial(jax.jit, static_argnames=("config", "use_filter"))
def _recompute_next(params: Params, tokens: jax.Array, lens: jax.Array,
                    sampling: SamplingParams, *, config: ModelConfig, use_filter: bool):
  """No cache: run the whole prefix tokens [B, S] again and sample at lens - 1
  -> (tokens [B], non-finite logits [B] bool)."""
  hidden = forward_hidden(params, config, tokens)
  last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
  logits = lm_logits(params, config, last)
  return sample(logits, sampling, lens, use_filter=use_filter), _nonfinite_rows(logits)


def _trim(row: np.ndarray, n: int, valid: int, eos_id: Optional[int]) -> tuple[list, str]:
  """A row's first n tokens, of which the first `valid` are good -> (tokens, finish reason)."""
  out = [int(t) for t in row[:min(n, valid)]]
  if eos_id is not None and eos_id in out:
    return out[:out.index(eos_id) + 1], "stop"
  return out, "error" if valid < n else "length"


def generate_static(params: Params, cfg: ModelConfig, prompts: list[list[int]],
                    max_new_tokens: int, sampling: SamplingParams, *, cache: str,
                    page_size: int, backend: str, dtype,
                    kv_dtype: Optional[str] = None) -> GenerateResult:
  """Generate for validated prompts; see kvjax.generate for the public contract."""
  mesh = mesh_of(params)  # a tensor-parallel model: pages and kernels per device
  backend = on_mesh(get_backend(backend), mesh)
  check_cache_support(kv_dtype, cfg, cache, backend)
  if page_size <= 0:
    raise ValueError(f"page_size must be positive, got {page_size}")
  num_prompts = len(prompts)
  rows = next_pow2(num_prompts)
  lens = np.zeros(rows, np.int32)
  lens[:num_prompts] = [len(p) for p in prompts]
  prompt_bucket = next_pow2(int(lens.max()), 8)
  tokens = np.zeros((rows, prompt_bucket), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  live = np.arange(rows) < num_prompts
  pad = rows - num_prompts
  sampling = jax.tree_util.tree_map(lambda x: jnp.pad(x, (0, pad), mode="edge"), sampling)
  use_filter = sampling.needs_filter
  eos_id = -1 if cfg.eos_token_id is None else cfg.eos_token_id
  total_bucket = next_pow2(int(lens.max()) + max_new_tokens, prompt_bucket)
  step_bucket = next_pow2(max_new_tokens - 1)

  start = time.perf_counter()
  if cache == "none":
    out, valid, ttft = _generate_without_cache(params, cfg, tokens, lens, sampling,
                                               max_new_tokens, eos_id, use_filter, start)
    pages_used = 0
  else:
    slot_ids = np.arange(rows, dtype=np.int32)
    if cache == "paged":
      pages_per_seq = -(-total_bucket // page_size)
      kv = create_paged_cache(cfg, kv_dtype, rows, 1 + rows * pages_per_seq, page_size, dtype,
                              mesh=mesh)
      tables = 1 + np.arange(rows * pages_per_seq, dtype=np.int32).reshape(rows, pages_per_seq)
    else:
      kv = create_contiguous_cache(cfg, rows, total_bucket, dtype, kv_dtype)
      tables = np.zeros((rows, 0), np.int32)
    # Prefill sees only the pages its prompts fill: attention work scales with the table.
    prompt_pages = -(-prompt_bucket // page_size)
    batch = make_step_batch(tokens, np.zeros(rows), lens * live, tables[:, :prompt_pages],
                            slot_ids, sampling)
    kv, logits, _ = prefill(params, kv, batch, config=cfg, backend=backend)
    first = sample(logits, sampling, jnp.asarray(lens), use_filter=use_filter)
    first_failed = np.asarray(_nonfinite_rows(logits))
    first.block_until_ready()
    ttft = time.perf_counter() - start
    batch = make_step_batch(first[:, None], lens * live, live, tables, slot_ids, sampling)
    kv, rest, failed_at = _decode_loop(params, kv, batch, jnp.int32(max_new_tokens - 1),
                                       jnp.int32(eos_id), config=cfg, backend=backend,
                                       max_steps=step_bucket, use_filter=use_filter)
    out = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
    # Good tokens per row: none after a failed prefill, the first + those before a failed step.
    failed_at = np.asarray(failed_at)
    valid = np.where(first_failed, 0, np.where(failed_at < step_bucket, 1 + failed_at,
                                               max_new_tokens))
    pages_used = None
  elapsed = time.perf_counter() - start
  new_tokens, reasons = zip(*[_trim(out[i], max_new_tokens, int(valid[i]), cfg.eos_token_id)
                               for i in range(num_prompts)])
  new_tokens = list(new_tokens)
  if pages_used is None:
    pages_used = sum(-(-(len(p) + len(n)) // page_size) for p, n in zip(prompts, new_tokens))
  total_new = sum(len(n) for n in new_tokens)
  longest = max(len(n) for n in new_tokens)
  stats = {
      "ttft_s": ttft,
      "tpot_s": (elapsed - ttft) / (longest - 1) if longest > 1 else 0.0,
      "tokens_per_s": total_new / elapsed,
      "latency_s": elapsed,
      "kv_pages_used": pages_used if cache == "paged" else 0,
      "num_generated_tokens": total_new,
      "cache": cache,
      "finish_reasons": list(reasons),
  }
  return GenerateResult(tokens=new_tokens, stats=stats)


def _generate_without_cache(params, cfg, tokens, lens, sampling, max_new_tokens, eos_id,
                            use_filter, start):
  """Recompute the whole prefix for every token: the quadratic baseline
  -> (tokens [rows, max_new_tokens], good tokens per row [rows], ttft)."""
  rows = tokens.shape[0]
  buffer = np.zeros((rows, next_pow2(int(lens.max()) + max_new_tokens, 8)), np.int32)
  buffer[:, :tokens.shape[1]] = tokens
  lens = lens.copy()
  lens[lens == 0] = 1  # padding rows: keep the gather in range
  out = np.full((rows, max_new_tokens), -1, np.int32)
  done = np.zeros(rows, bool)
  valid = np.full(rows, max_new_tokens)
  ttft = 0.0
  for step in range(max_new_tokens):
    width = next_pow2(int(lens.max()), 8)
    new, failed = jax.device_get(_recompute_next(
        params, jnp.asarray(buffer[:, :width]), jnp.asarray(lens), sampling, config=cfg,
        use_filter=use_filter))
    failed = failed & ~done  # device_get arrays are read-only
    valid[failed] = step
    if step == 0:
      ttft = time.perf_counter() - start
    out[:, step] = new
    buffer[np.arange(rows), lens] = new
    lens += 1
    done |= failed | (new == eos_id)
    if done.all():
      break
  return out, valid, ttft
