"""Explicit registry of paged-attention backends, chosen by name.

Every backend takes kvjax's padded layout
  `backend(q [B, T, N, H], k_pages, v_pages [K, P, G, H], kv_lens [B],
           block_tables [B, Pmax], *, sm_scale, sliding_window=None, soft_cap=None,
           k_scales=None, v_scales=None) -> [B, T, N, H]`
where row i of batch row b sits at position kv_lens[b] - T + i.

Names:
  reference         kvjax's pure-jnp gather (default; any device)
  pallas            pallas_kernels.ragged_paged_attention compiled for the GPU
  pallas_interpret  the same kernel in interpret mode (CPU tests)
  pallas_reference  pallas_kernels' own jnp reference of the ragged contract
The Pallas entries flatten [B, T] into the kernel's ragged layout
(cu_q_lens = b * T): with every row counted in kv_lens the positions agree.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp

from kvjax.attention.paged import paged_attention

__all__ = ["register_backend", "get_backend", "backend_names"]

_BACKENDS: dict[str, Callable] = {"reference": paged_attention}


def register_backend(name: str, fn: Callable) -> None:
  """Add a backend (a researcher's variant) under `name`."""
  if name in _BACKENDS or name in _PALLAS_MODES:
    raise ValueError(f"attention backend {name!r} is already registered")
  _BACKENDS[name] = fn


def _ragged(mode: str) -> Callable:
  import pallas_kernels  # kept lazy: the reference backend must not need Pallas

  if mode == "pallas_reference":
    kernel = pallas_kernels.ragged_paged_attention_reference
  else:
    kernel = functools.partial(pallas_kernels.ragged_paged_attention,
                               interpret=(mode == "pallas_interpret"))

  def backend(q, k_pages, v_pages, kv_lens, block_tables, **kwargs):
    b, t, n, h = q.shape
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * t
    out = kernel(q.reshape(b * t, n, h), k_pages, v_pages, kv_lens.astype(jnp.int32),
                 block_tables.astype(jnp.int32), cu_q_lens, **kwargs)
    return out.reshape(b, t, n, h)

  return backend


_PALLAS_MODES = ("pallas", "pallas_interpret", "pallas_reference")


def backend_names() -> list[str]:
  return sorted(set(_BACKENDS) | set(_PALLAS_MODES))


def get_backend(name: str) -> Callable:
  if name in _BACKENDS:
    return _BACKENDS[name]
  if name in _PALLAS_MODES:
    return _ragged(name)
  raise ValueError(f"unknown attention backend {name!r}; known: {backend_names()}")
