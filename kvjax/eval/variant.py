"""A variant of a loaded model: its window, its engine options checked, its KV bytes.

Weight variants are chosen at load time (kvjax.load_checkpoint's weight_dtype);
what the engine decides (kv_dtype, page_size, backend) is validated here by
EngineConfig.resolve, the Engine's own checks, so an evaluation refuses
exactly what serving would.  A sliding window is a model property
(ModelConfig.sliding_window, every layer); kvjax has no attention sinks, so a
window alone is what can be measured.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from kvjax.api import Model
from kvjax.caches import create_paged_cache
from kvjax.engine_config import EngineConfig

__all__ = ["with_window", "resolved_engine_config", "kv_bytes_per_token"]


def with_window(model: Model, sliding_window: Optional[int]) -> Model:
  """`model` whose every layer attends to its last `sliding_window` tokens (None: as loaded)."""
  if sliding_window is None:
    return model
  if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
      or sliding_window < 1:
    raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
  config = dataclasses.replace(model.config, sliding_window=sliding_window, layer_windows=None)
  return dataclasses.replace(model, config=config)


def resolved_engine_config(model: Model, **options) -> EngineConfig:
  """EngineConfig(**options) checked against `model` (ValueError naming a bad option)."""
  return EngineConfig(**options).resolve(model)


def kv_bytes_per_token(model: Model, kv_dtype: Optional[str], page_size: int) -> float:
  """Bytes one cached token takes in the pool (pages + scales), from the allocated arrays;
  int4's per-slot residual is a fixed cost per request, left out."""
  num_pages = 64
  cache = jax.eval_shape(lambda: create_paged_cache(model.config, kv_dtype, 1, num_pages,
                                                    page_size, model.dtype))
  fields = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
  stored = sum(x.size * x.dtype.itemsize for name, x in fields.items()
               if x is not None and not name.endswith("residual"))
  return stored / (num_pages * page_size)
