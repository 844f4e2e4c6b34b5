"""Checks that refuse a bad load early: a model too big for the device, non-finite weights.

Fit.  `check_fits` runs on the config alone, before anything is allocated: the
ledger's weight bytes at the requested dtype (plus, on CPU, the float32 copy XLA
multiplies 16-bit weights with) and a minimal KV cache (one request of
`MIN_KV_TOKENS`, at the weights' dtype as the caches default to) against what
the device has free (an accelerator's `bytes_limit - bytes_in_use`;
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

from kvjax.model.config import DTYPE_SHORT_NAMES, ModelConfig
from kvjax.parallel import ledger

__all__ = ["MIN_KV_TOKENS", "available_device_bytes", "needed_bytes", "check_fits",
           "nonfinite_count", "raise_first_nonfinite", "check_finite_tree"]

# The smallest useful cache: one request this long (or the whole context if shorter).
MIN_KV_TOKENS = 2048
_MIB = 1 << 20


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
  """Free bytes on `device`, None if unknown.  Default: this process's first device
  (in a multi-host run jax.devices()[0] may belong to another process)."""
  device = jax.local_devices()[0] if device is None else device
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  if device.platform == "cpu":
    return _meminfo_available_bytes()
  return None


def _size(num_bytes: int) -> str:
  if num_bytes >= ledger.GIB:
    return f"{num_bytes / ledger.GIB:.1f} GiB"
  return f"{num_bytes / _MIB:.1f} MiB"


def needed_bytes(cfg: ModelConfig, dtype: str, platform: str) -> dict[str, int]:
  """What holds memory once `cfg` is loaded at `dtype` (a short name) -> its bytes."""
  needs = {f"{dtype} weights": ledger.weight_bytes(cfg, dtype)}
  if platform == "cpu" and dtype != "fp32":
    # XLA's CPU backend has no 16-bit matmul: it converts every multiplied weight to
    # float32 and keeps the copies live through the program (issue 12's bfloat16 llama3-8b
    # run died allocating 30,027,059,332 bytes: its 7.5G non-embedding weights x 4 B).
    gathered = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    needs["the float32 copy XLA's CPU backend multiplies with"] = 4 * (
        ledger.param_count(cfg) - gathered)
  context = min(cfg.max_position_embeddings, MIN_KV_TOKENS)
  needs[f"KV cache (one {context}-token request)"] = ledger.kv_bytes_per_request(
      cfg, context, kv_dtype=dtype)
  return needs


def check_fits(cfg: ModelConfig, dtype, available_bytes: Optional[int] = None,
               platform: Optional[str] = None) -> None:
  """Raise ValueError unless `cfg` at `dtype` (needed_bytes) fits the default device.

  `available_bytes` overrides the measured free memory (None: measure; a device
  that reports nothing skips the check), `platform` the device's ("cpu", "gpu").
  """
  device = jax.local_devices()[0]
  platform = device.platform if platform is None else platform
  if available_bytes is None:
    available_bytes = available_device_bytes(device)
    if available_bytes is None:
      return
    source = f"{device} has"
  else:
    if isinstance(available_bytes, bool) or not isinstance(available_bytes, (int, np.integer)) \
        or available_bytes < 0:
      raise ValueError(f"available_bytes must be an int >= 0, got {available_bytes!r}")
    source = f"available_bytes={available_bytes} gives"
  short = DTYPE_SHORT_NAMES[np.dtype(dtype).name]
  needs = needed_bytes(cfg, short, platform)
  total = sum(needs.values())
  if total <= available_bytes:
    return
  totals = {name: sum(needed_bytes(cfg, other, platform).values())
            for name, other in DTYPE_SHORT_NAMES.items()}
  fitting = [f"dtype={name!r} (--dtype {name}) needs {_size(need)}"
             for name, need in sorted(totals.items(), key=lambda kv: kv[1])
             if need <= available_bytes]
  advice = ("would fit: " + "; ".join(fitting)) if fitting else (
      "no dtype kvjax loads fits; kvjax places the whole model on one device, so use one "
      f"with at least {_size(min(totals.values()))} free")
  quantized = ", ".join(f"{q} {_size(ledger.weight_bytes(cfg, q))}" for q in ("int8", "int4"))
  raise ValueError(
      f"{cfg.name} needs " + " + ".join(f"{_size(n)} of {what}" for what, n in needs.items())
      + f" = {_size(total)}, but {source} {_size(available_bytes)} available; {advice} "
      f"(int8/int4 weights, {quantized}, come from kvjax.weights.quantize.quantize_params "
      "after a float load, so the float load must fit first)")


@jax.jit
def nonfinite_count(x: jax.Array) -> jax.Array:
  """NaN and inf values in `x`, counted on its device (an int32 scalar)."""
  return jnp.count_nonzero(~jnp.isfinite(x))


@jax.jit
def _nonfinite_counts(leaves: list) -> jax.Array:
  """[L] int32: nonfinite_count of every leaf, one program for the whole tree."""
  return jnp.stack([nonfinite_count(x) for x in leaves])


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
