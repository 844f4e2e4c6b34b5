"""A variant of a loaded model: its name's options, its window, its engine options
checked, its KV bytes.

Weight variants are chosen at load time (kvjax.load_checkpoint's weight_dtype);
what the engine decides (kv_dtype, page_size, backend) is validated here by
EngineConfig.resolve, the Engine's own checks, so an evaluation refuses
exactly what serving would.  A sliding window is a model property
(ModelConfig.sliding_window, every layer); attention sinks + a window are the
attention variant sinks_window (kvjax/attention/variants.py) named as a kv_dtype
(kvjax/caches/paged.py variant_layout), so "sinks<S>-window<W>" is a kv_dtype: the
float pages under the variant, which masks (and frees) what lies between.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

from kvjax.api import Model
from kvjax.attention.variants import sinks_window
from kvjax.caches.layout import PoolSizes, get_layout, register, store_name
from kvjax.caches.paged import variant_layout
from kvjax.engine.config import EngineConfig

__all__ = ["parse_variant", "with_window", "resolved_engine_config", "kv_bytes_per_token"]

_SINKS_WINDOW = re.compile(r"sinks(\d+)-window(\d+)")


def parse_variant(name: str) -> dict:
  """'float' | 'kv-<dtype>' | 'window-<N>' | 'sinks<S>-window<W>' | 'weights-<scheme>' ->
  load / engine options (weight_dtype, kv_dtype, sliding_window).  sinks + window
  registers variant_layout(sinks_window(S, W)) under the variant's name, its kv_dtype."""
  options = dict(weight_dtype=None, kv_dtype=None, sliding_window=None)
  kind, _, value = name.partition("-")
  if name == "float":
    return options
  if kind == "kv" and value:
    return options | dict(kv_dtype=value)
  if kind == "window" and value.isdigit():
    return options | dict(sliding_window=int(value))
  sizes = _SINKS_WINDOW.fullmatch(name)
  if sizes:
    if int(sizes[1]) < 1:
      raise ValueError(f"variant {name!r}: sinks must be >= 1 (none: window-{sizes[2]})")
    try:
      layout = variant_layout(sinks_window(int(sizes[1]), int(sizes[2])))
    except ValueError as error:
      raise ValueError(f"variant {name!r}: {error}") from None
    return options | dict(kv_dtype=register(layout).name)
  if kind == "weights" and value:
    return options | dict(weight_dtype=value)
  raise ValueError(f"unknown variant {name!r}: use float, kv-<dtype>, window-<N>, "
                   "sinks<S>-window<W> or weights-<scheme>")


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
  """Bytes one cached token takes in the pool: the layout's page arrays (values + scales)
  over their tokens; per-slot arrays (int4's residual) are a fixed cost per request, left
  out.  Sinks + window pages cost what float pages do (what it frees is per request)."""
  num_pages = 64
  layout = get_layout(kv_dtype, model.config)
  specs = layout.arrays(model.config, layout.store or store_name(model.dtype),
                        PoolSizes(num_pages, page_size, 1))
  return sum(a.nbytes for a in specs.values() if a.role == "page") / (num_pages * page_size)
