"""Teacher-forced perplexity through the paged KV cache a variant serves with.

The ids are cut into segments of `context` + 1 tokens (consecutive segments
share one token, so every id after the first is scored exactly once).  Each
segment runs as the engine runs a request: its first context - decode_tokens
inputs as prefill chunks of `chunk` columns, then one input per decode step
(padded to the chunk's width, as the engine pads a row group), every step
writing its K/V into pages of the variant's store (kv_dtype: a float, int8
with scales, int4 KIVI with its full-precision residual) and reading every
earlier token back from them through the backend, under the model's sliding
window.  Every column scores the real next id: log p(x[t+1] | x[<=t]) from that
step's logits, so the cache's quantization and window are what is measured,
not a cache-free forward.  Segments run `batch_size` at a time as rows of one
StepBatch.

Reported: nats/token (mean -log p), perplexity, bits/byte (total nats / ln 2
over the UTF-8 bytes of the scored tokens' text) and the token count.
"""
from __future__ import annotations

import functools
import math
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.api import Model
from kvjax.caches import create_paged_cache
from kvjax.caches.layout import with_layout_variant
from kvjax.eval.variant import kv_bytes_per_token, resolved_engine_config, with_window
from kvjax.model.config import ModelConfig
from kvjax.model.decoder import lm_logits
from kvjax.model.params import Params
from kvjax.runtime.step_batch import make_step_batch
from kvjax.runtime.steps import model_step

__all__ = ["segments", "score_segments", "perplexity"]


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("cache",))
def _score_step(params: Params, cache, batch, targets: jax.Array, *, config: ModelConfig,
                backend):
  """Feed batch [B, T] through the cache -> (cache, log p(targets) [B, T] f32)."""
  cache, hidden = model_step(params, cache, batch, config=config, backend=backend)
  logp = jax.nn.log_softmax(lm_logits(params, config, hidden).astype(jnp.float32), axis=-1)
  return cache, jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def segments(ids: Sequence[int], context: int) -> np.ndarray:
  """ids -> [S, context + 1] int32 windows, stride `context` (the tail that fills no
  whole window is dropped)."""
  ids = np.asarray(ids, np.int32)
  count = (len(ids) - 1) // context
  if count < 1:
    raise ValueError(f"{len(ids)} token ids make no segment of context {context} + 1")
  return np.stack([ids[i * context:i * context + context + 1] for i in range(count)])


def score_segments(model: Model, windows: np.ndarray, *, chunk: int = 128,
                   decode_tokens: int = 0, page_size: int = 16, kv_dtype: Optional[str] = None,
                   backend="reference", batch_size: int = 4, progress: bool = True
                   ) -> np.ndarray:
  """windows [S, C + 1] -> log p [S, C] of windows[:, 1:] through the paged cache
  (module doc: chunks, then decode steps)."""
  s, width = windows.shape
  context = width - 1
  if not 0 <= decode_tokens <= context:
    raise ValueError(f"decode_tokens must be in [0, context={context}], got {decode_tokens}")
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}")
  model = with_layout_variant(model, kv_dtype)  # an alias's variant ("streaming") on its steps
  engine = resolved_engine_config(model, page_size=page_size, kv_dtype=kv_dtype,
                                  backend=backend, max_model_len=context)
  pages_per_row = -(-context // page_size)
  prefill_len = context - decode_tokens
  # (first position, inputs fed): prefill chunks, then one input per decode step.  Every
  # step is `chunk` columns wide, a decode step's padding columns writing the null page
  # as the engine pads a row group, so one compiled program serves both.
  steps = [(start, min(chunk, prefill_len - start)) for start in range(0, prefill_len, chunk)]
  steps += [(start, 1) for start in range(prefill_len, context)]
  out = np.zeros((s, context), np.float32)
  for first in range(0, s, batch_size):
    rows = windows[first:first + batch_size]
    real = len(rows)
    rows = np.concatenate([rows, np.repeat(rows[-1:], batch_size - real, axis=0)])  # [B, C+1]
    cache = create_paged_cache(model.config, engine.kv_dtype, batch_size,
                               1 + batch_size * pages_per_row, page_size, model.dtype)
    tables = 1 + np.arange(batch_size * pages_per_row, dtype=np.int32).reshape(batch_size, -1)
    began = time.perf_counter()
    for start, length in steps:
      inputs = np.zeros((batch_size, chunk), np.int32)
      targets = np.zeros((batch_size, chunk), np.int32)
      inputs[:, :length] = rows[:, start:start + length]
      targets[:, :length] = rows[:, start + 1:start + 1 + length]
      batch = make_step_batch(inputs, np.full(batch_size, start), np.full(batch_size, length),
                              tables)
      cache, logp = _score_step(model.params, cache, batch, jnp.asarray(targets),
                                config=model.config, backend=engine.backend)
      out[first:first + real, start:start + length] = np.asarray(logp)[:real, :length]
    if progress:
      print(f"perplexity: segments {first + real}/{s} ({real * context} tokens in "
            f"{time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)
  return out


def _by_position(nats: np.ndarray, buckets: int = 16) -> list[dict]:
  """nats [S, C] -> mean nats per run of C / buckets positions (where a window starts to
  cost shows as a rise past it), each with its first position."""
  edges = np.linspace(0, nats.shape[1], min(buckets, nats.shape[1]) + 1).astype(int)
  return [dict(position=int(a), nats=float(nats[:, a:b].mean()))
          for a, b in zip(edges[:-1], edges[1:])]


def perplexity(model: Model, ids: Sequence[int], *, context: int = 512, chunk: int = 128,
               decode_tokens: int = 0, page_size: int = 16, kv_dtype: Optional[str] = None,
               sliding_window: Optional[int] = None, backend="reference",
               batch_size: int = 4, max_tokens: Optional[int] = None,
               progress: bool = True) -> dict:
  """Score `ids` (module doc) under one variant -> nats/token, perplexity, bits/byte,
  token count and the variant's KV bytes per token.  max_tokens: score at most that many."""
  variant = with_window(model, sliding_window)
  windows = segments(ids, context)
  if max_tokens is not None:
    windows = windows[:max(1, max_tokens // context)]
  logp = score_segments(variant, windows, chunk=chunk, decode_tokens=decode_tokens,
                        page_size=page_size, kv_dtype=kv_dtype, backend=backend,
                        batch_size=batch_size, progress=progress)
  nats = -float(np.sum(logp, dtype=np.float64))
  tokens = int(logp.size)
  result = dict(nats_per_token=nats / tokens, perplexity=math.exp(nats / tokens),
                tokens=tokens, context=context, chunk=chunk, decode_tokens=decode_tokens,
                page_size=page_size, kv_dtype=kv_dtype, sliding_window=sliding_window,
                kv_bytes_per_token=kv_bytes_per_token(model, kv_dtype, page_size),
                nats_by_position=_by_position(-logp))
  if model.tokenizer is not None:
    scored = sum(len(model.tokenizer.decode(w[1:].tolist(), skip_special_tokens=False)
                     .encode("utf-8")) for w in windows)
    result.update(bytes=scored, bits_per_byte=nats / math.log(2) / scored)
  return result
