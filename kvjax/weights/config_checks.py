"""Bounds on a checkpoint's config fields (HF config.json, GGUF metadata), checked as they
are read: a corrupt or hostile value is a ValueError naming the file, the field and the
value before any loop or allocation it sizes runs.

A layer count past MAX_LAYERS would spin the per-layer Python loops of the fit check and
the loaders for minutes (issue 53: 1e9 layers, > 240 s); a context past MAX_CONTEXT is no
model anyone ships and sizes the Engine's default page pool past int32 page ids."""
from __future__ import annotations

import math
import numbers
from typing import Optional

__all__ = ["MAX_LAYERS", "MAX_CONTEXT", "count_field", "positive_real_field",
           "check_hf_fields"]

MAX_LAYERS = 4096  # released models have under 200 (DeepSeek-V3: 61, Llama-3.1-405B: 126)
MAX_CONTEXT = 1 << 24  # 16M tokens (the longest released contexts are 10M)


def _prefix(where: str) -> str:
  return f"{where}: " if where else ""


def count_field(where: str, field: str, value, high: Optional[int] = None) -> int:
  """An int field in [1, high] (high None: no bound) -> int; ValueError naming it."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{_prefix(where)}{field} must be an int, got {value!r:.200} "
                     f"({type(value).__name__})")
  if value < 1 or (high is not None and value > high):
    bound = "a positive int" if high is None else f"in [1, {high}]"
    raise ValueError(f"{_prefix(where)}{field} must be {bound}, got {value}")
  return int(value)


def positive_real_field(where: str, field: str, value) -> float:
  """A finite number > 0 (a rope base, an RMS epsilon) -> float; ValueError naming it."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{_prefix(where)}{field} must be a number, got {value!r:.200} "
                     f"({type(value).__name__})")
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{_prefix(where)}{field} must be a finite number > 0, got {value!r}")
  return float(value)


def check_hf_fields(hf: dict) -> None:
  """An HF config.json's size fields (a multimodal one's text_config), where present:
  counts bounded, rope base and RMS epsilon finite and > 0 (the caller names the file)."""
  text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
  bounds = {"num_hidden_layers": MAX_LAYERS, "max_position_embeddings": MAX_CONTEXT,
            "num_attention_heads": None, "hidden_size": None, "vocab_size": None}
  for field, high in bounds.items():
    if field in text:
      count_field("", field, text[field], high)
  for field in ("rope_theta", "rms_norm_eps"):
    if text.get(field) is not None:
      positive_real_field("", field, text[field])
