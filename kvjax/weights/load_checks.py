"""Checks that refuse a bad load early: a model too big for the device, non-finite weights.

Fit.  `check_fits` runs on the config alone, before anything is allocated: the
ledger's weight bytes at the requested dtype plus a minimal KV cache (one
request of `MIN_KV_TOKENS`, at the weights' dtype as the caches default to)
against what the device has free (an accelerator's `bytes_limit - bytes_in_use`;
on CPU, /proc/meminfo's MemAvailable).  The error names both sides and what
would fit instead, so an 8B model on a small machine fails in a second rather
than after minutes in the OOM killer.

Finite.  NaN/inf values are counted on device, one reduction per tensor: as
each HF tensor loads (`nonfinite_count`, so no raw tensor outlives its
conversion) or one jitted program over a whole Params tree; the counts come back
in one host transfer and `raise_first_nonfinite` names the first bad tensor.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import ledger
from kvjax.config import DTYPE_SHORT_NAMES, ModelConfig

__all__ = ["MIN_KV_TOKENS", "available_device_bytes", "check_fits", "nonfinite_count",
           "raise_first_nonfinite", "check_finite_tree"]

# The smallest useful cache: one request this long (or the whole context if shorter).
MIN_KV_TOKENS = 2048


def _meminfo_available_bytes() -> Optional[int]:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * ledger.KIB  # the kernel writes kB meaning KiB.
  except OSError:
    pass
  return None


def available_device_bytes(device: Optional[jax.Device] = None) -> Optional[int]:
  """Free bytes on `device` (default: where jnp places arrays); None if unknown."""
  device = jax.devices()[0] if device is None else device
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  if device.platform == "cpu":
    return _meminfo_available_bytes()
  return None


def _gib(num_bytes: int) -> str:
  return f"{num_bytes / ledger.GIB:.1f} GiB"


def _needed_bytes(cfg: ModelConfig, dtype: str) -> tuple[int, int]:
  """(weight bytes, minimal KV bytes) of `cfg` held at `dtype` (a short name)."""
  context = min(cfg.max_position_embeddings, MIN_KV_TOKENS)
  return (ledger.weight_bytes(cfg, dtype),
          ledger.kv_bytes_per_request(cfg, context, kv_dtype=dtype))


def check_fits(cfg: ModelConfig, dtype, available_bytes: Optional[int] = None) -> None:
  """Raise ValueError unless `cfg`'s weights at `dtype` plus a minimal KV cache fit.

  `available_bytes` overrides the measured free memory (None: measure; a device
  that reports nothing skips the check).
  """
  if available_bytes is None:
    available_bytes = available_device_bytes()
    if available_bytes is None:
      return
    source = f"{jax.devices()[0]} has"
  else:
    if isinstance(available_bytes, bool) or not isinstance(available_bytes, (int, np.integer)) \
        or available_bytes < 0:
      raise ValueError(f"available_bytes must be an int >= 0, got {available_bytes!r}")
    source = f"available_bytes={available_bytes} gives"
  short = DTYPE_SHORT_NAMES[np.dtype(dtype).name]
  weights, kv = _needed_bytes(cfg, short)
  if weights + kv <= available_bytes:
    return
  context = min(cfg.max_position_embeddings, MIN_KV_TOKENS)
  smaller = []
  for name, other in DTYPE_SHORT_NAMES.items():
    w, k = _needed_bytes(cfg, other)
    if w + k < weights + kv:
      smaller.append((w + k, name, other))
  fitting = [f"dtype={name!r} (--dtype {name}) needs {_gib(total)}"
             for total, name, _ in sorted(smaller) if total <= available_bytes]
  least = min([total for total, _, _ in smaller] + [weights + kv])
  quantized = ", ".join(f"{q} {_gib(ledger.weight_bytes(cfg, q))}" for q in ("int8", "int4"))
  advice = ("would fit: " + "; ".join(fitting)) if fitting else (
      f"no dtype kvjax loads fits; kvjax places the whole model on one device, so use one "
      f"with at least {_gib(least)} free")
  raise ValueError(
      f"{cfg.name} at {short} needs {_gib(weights)} of weights + {_gib(kv)} of KV cache (one "
      f"{context}-token request) = {_gib(weights + kv)}, but {source} {_gib(available_bytes)} "
      f"available; {advice} (int8/int4 weights, {quantized}, come from "
      "kvjax.weights.quantize.quantize_params after a float load, so the float load must "
      "fit first)")


@jax.jit
def nonfinite_count(x: jax.Array) -> jax.Array:
  """NaN and inf values in `x`, counted on its device (an int32 scalar)."""
  return jnp.count_nonzero(~jnp.isfinite(x))


@jax.jit
def _nonfinite_counts(leaves: list) -> jax.Array:
  """[L] int32: nonfinite_count of every leaf, one program for the whole tree."""
  return jnp.stack([jnp.count_nonzero(~jnp.isfinite(x)) for x in leaves])


def raise_first_nonfinite(names: Sequence[str], counts, sizes: Sequence[int],
                          what: str) -> None:
  """counts: the device counts of the tensors `names` (sizes `sizes`), in load order.
  Raise ValueError naming the first tensor with a non-finite value."""
  counts = np.asarray(jax.device_get(counts))  # the check's one host transfer.
  bad = np.flatnonzero(counts)
  if bad.size:
    first = bad[0]
    others = f" ({bad.size - 1} more tensors have some too)" if bad.size > 1 else ""
    raise ValueError(f"{what} tensor {names[first]} has {counts[first]} non-finite values "
                     f"(NaN or inf) of {sizes[first]}{others}; such weights generate garbage "
                     "(pass check_finite=False to load it anyway)")


def check_finite_tree(params, what: str) -> None:
  """raise_first_nonfinite over every float leaf of a Params tree, named by tree path."""
  leaves = [(jax.tree_util.keystr(path).lstrip("."), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
            if jnp.issubdtype(leaf.dtype, jnp.inexact)]
  raise_first_nonfinite([name for name, _ in leaves],
                        _nonfinite_counts([leaf for _, leaf in leaves]),
                        [leaf.size for _, leaf in leaves], what)
