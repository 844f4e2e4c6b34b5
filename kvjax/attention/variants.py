"""Attention variants: what a query sees and how it weighs it, as two functions over positions.

A variant is a frozen record of plain functions (hashable, so it rides in the static
ModelConfig under jit; `ModelConfig.attention_variant`):
  mask(q_pos, kv_pos) -> bool            True where the query at q_pos may see key kv_pos
  score(s, q_pos, kv_pos, head) -> s     s: the scaled score q.k * sm_scale, float32
both written with element-wise jnp ops over broadcast integer arrays of LOGICAL positions
(never pages or slots) and the query head index (kv head k, group g -> head k * Gq + g).
Every path (the no-cache forward, the paged reference backend's gather and block walk,
the gathered decode loop, the contiguous and int4 caches) calls the helpers below, so
they all apply the same rule.  A layer's rule is `layer_variant`: the model's own window
(ModelConfig.sliding_window / layer_windows, a `sliding_window`) and the attention=
variant joined by `both` (masks ANDed, scores in turn, the tighter kv_range); causality
applies on top.  The score runs after the model's soft-cap, before the softmax.

  monotone   declares that a key hidden from a query stays hidden from later ones: the
             Engine releases the pages it hides (kvjax/engine/sched/mask_release.py)
  kv_range   (q_pos) -> (lo, hi): no key outside [lo, hi) is visible to q_pos, but for
             the first `leading_keys`; the reference backend's block walk (a prefill
             chunk's, and a decode step's) reads the leading keys' blocks, then starts
             at the lowest lo (hi unused)
  leading_keys  keys 0 .. leading_keys - 1 (attention sinks) may be visible outside
             kv_range: a walk reads their blocks too, and skips what lies between

Parameters (a window, ALiBi slopes) are closed over as Python or numpy constants at this
stage, so a new value is a new record and compiles anew; pytree parameters that change
without recompiling are a later stage.  The built-ins are cached, so the same arguments
give the same record (one compilation).  Names resolve through `register_variant`, and
the built-ins by their records' names ("window512"; `get_variant`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from kvjax.model.config import ModelConfig

__all__ = ["AttentionVariant", "register_variant", "get_variant", "variant_names",
           "with_attention", "variant_mask", "variant_scores", "first_key", "skipping_range",
           "sliding_window", "sinks_window", "soft_cap", "parse_variant_name", "both",
           "layer_variant", "BUILT_IN_NAMES"]


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
  name: str
  mask: Optional[Callable] = None  # (q_pos, kv_pos) -> bool, broadcast
  score: Optional[Callable] = None  # (s, q_pos, kv_pos, head) -> s, broadcast
  monotone: bool = False
  kv_range: Optional[Callable] = None  # (q_pos) -> (lo, hi)
  leading_keys: int = 0  # the first keys, visible outside kv_range (sinks)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"AttentionVariant.name must be a non-empty str, got {self.name!r}")
    for field in ("mask", "score", "kv_range"):
      value = getattr(self, field)
      if value is not None and not callable(value):
        raise ValueError(f"AttentionVariant.{field} must be a function or None, got "
                         f"{type(value).__name__}")
    if not isinstance(self.monotone, bool):
      raise ValueError(f"AttentionVariant.monotone must be a bool, got {self.monotone!r}")
    if isinstance(self.leading_keys, bool) or not isinstance(self.leading_keys, int) or \
        self.leading_keys < 0:
      raise ValueError(f"AttentionVariant.leading_keys must be an int >= 0, got "
                       f"{self.leading_keys!r}")


_REGISTRY: dict[str, AttentionVariant] = {}


def register_variant(variant: AttentionVariant) -> AttentionVariant:
  """Make `variant` known by its name (e.g. for `attention="landmark"`) -> the variant.
  ValueError if another variant already has that name."""
  if not isinstance(variant, AttentionVariant):
    raise ValueError(f"register_variant takes an AttentionVariant, got "
                     f"{type(variant).__name__}")
  known = _REGISTRY.get(variant.name)
  if known is not None and known != variant:
    raise ValueError(f"an attention variant named {variant.name!r} is already registered")
  _REGISTRY[variant.name] = variant
  return variant


def variant_names() -> list[str]:
  return sorted(_REGISTRY)


def get_variant(name: str) -> AttentionVariant:
  """The variant registered as `name`, or a built-in named as its record is
  ("window512", "sinks4-window1020", "softcap30"); ValueError naming the known ones."""
  if name in _REGISTRY:
    return _REGISTRY[name]
  for pattern, build in _BUILT_INS:
    match = re.fullmatch(pattern, name)
    if match:
      return build(*match.groups())
  raise ValueError(f"unknown attention variant {name!r}; registered: {variant_names()}, "
                   f"built in: {', '.join(BUILT_IN_NAMES)}")


def parse_variant_name(text: str) -> str:
  """argparse type of --attention: `text` if it names a variant, else ArgumentTypeError."""
  try:
    get_variant(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(str(error)) from None
  return text


AttentionArg = Union[None, str, AttentionVariant, Callable]


def _one(value, where: str) -> Optional[AttentionVariant]:
  if value is None or isinstance(value, AttentionVariant):
    return value
  if isinstance(value, str):
    return get_variant(value)
  raise ValueError(f"{where} must be an AttentionVariant, a registered name or None, got "
                   f"{type(value).__name__}")


def _resolve(cfg: ModelConfig, attention: AttentionArg):
  """attention -> ModelConfig.attention_variant: a variant, or one entry per cache layer."""
  if attention is None or isinstance(attention, (str, AttentionVariant)):
    return _one(attention, "attention")
  if not callable(attention):
    raise ValueError(f"attention must be an AttentionVariant, a registered name, a function "
                     f"(cfg, layer) -> variant or None, or None; got "
                     f"{type(attention).__name__}")
  per_layer = tuple(_one(attention(cfg, layer), f"attention(cfg, {layer})")
                    for layer in range(cfg.num_cache_layers))
  return None if all(v is None for v in per_layer) else per_layer


def with_attention(model, attention: AttentionArg):
  """`model` (a kvjax.Model) whose config carries `attention` (None: the model unchanged)."""
  if attention is None:
    return model
  config = model.config.replace(attention_variant=_resolve(model.config, attention))
  return dataclasses.replace(model, config=config)


@functools.cache
def both(first: Optional[AttentionVariant],
         second: Optional[AttentionVariant]) -> Optional[AttentionVariant]:
  """The two variants at once (None: the other one; both None: None): a key is visible iff
  both masks show it, the scores run first's then second's, kv_range is the tighter of the
  two.  Keys outside that range are visible only if one of the two lets them be (its
  leading keys), so the leading keys are the larger count; monotone if each is (a variant
  without a mask hides nothing: it counts as monotone).  Cached: the same two give the
  same record (one compilation)."""
  if first is None or second is None:
    return second if first is None else first
  masks = [v.mask for v in (first, second) if v.mask is not None]
  scores = [v.score for v in (first, second) if v.score is not None]
  ranges = [v.kv_range for v in (first, second) if v.kv_range is not None]
  hides_monotonically = lambda v: v.monotone or v.mask is None
  return AttentionVariant(
      f"{first.name}+{second.name}", mask=_joined(masks, _both_masks),
      score=_joined(scores, _scores_in_turn), kv_range=_joined(ranges, _tighter_range),
      monotone=hides_monotonically(first) and hides_monotonically(second),
      leading_keys=max(first.leading_keys, second.leading_keys))


def _joined(functions: list, join: Callable) -> Optional[Callable]:
  """None, the one function, or the two joined."""
  return join(*functions) if len(functions) == 2 else (functions or [None])[0]


def _both_masks(first: Callable, second: Callable) -> Callable:
  # `&`, not jnp: mask_release evaluates masks on numpy arrays
  return lambda q, k: first(q, k) & second(q, k)


def _scores_in_turn(first: Callable, second: Callable) -> Callable:
  return lambda s, q, k, h: second(first(s, q, k, h), q, k, h)


def _tighter_range(first: Callable, second: Callable) -> Callable:
  def kv_range(q):
    (lo_a, hi_a), (lo_b, hi_b) = first(q), second(q)
    return jnp.maximum(lo_a, lo_b), jnp.minimum(hi_a, hi_b)
  return kv_range


def layer_variant(cfg: ModelConfig, layer: int) -> Optional[AttentionVariant]:
  """What cache layer `layer` of cfg attends with: its model window (`window_of_layer`, a
  `sliding_window`) and its attention= variant (`variant_of_layer`) together, or None.
  The one rule every attention path applies (causality on top)."""
  window = cfg.window_of_layer(layer)
  return both(None if window is None else sliding_window(window), cfg.variant_of_layer(layer))


def variant_mask(variant: Optional[AttentionVariant], q_positions: jax.Array,
                 k_positions: jax.Array) -> Optional[jax.Array]:
  """q_positions [B, T, 1], k_positions [B or 1, 1, S] -> [B, T, S] bool, or None (no mask)."""
  if variant is None or variant.mask is None:
    return None
  return jnp.asarray(variant.mask(q_positions, k_positions), bool)


def variant_scores(variant: Optional[AttentionVariant], q_positions: jax.Array,
                   k_positions: jax.Array) -> Optional[Callable]:
  """q_positions [B, T], k_positions [B or 1, S] -> a function of scores [K, B, Gq, T, S]
  (the kv-head-major layout of kvjax/attention/dense.py), or None (no score)."""
  if variant is None or variant.score is None:
    return None

  def scores(s: jax.Array) -> jax.Array:
    num_kv, _, group = s.shape[:3]
    head = jnp.arange(num_kv * group).reshape(num_kv, 1, group, 1, 1)
    out = variant.score(s, q_positions[None, :, None, :, None],
                        k_positions[None, :, None, None, :], head)
    return jnp.broadcast_to(jnp.asarray(out, s.dtype), s.shape)

  return scores


def first_key(variant: Optional[AttentionVariant],
              q_positions: jax.Array) -> Optional[jax.Array]:
  """q_positions [B, T] -> [B]: no query of the row sees a key before it (from kv_range)
  but the variant's leading keys, or None where the variant gives no bound."""
  if variant is None or variant.kv_range is None:
    return None
  lo, _ = variant.kv_range(q_positions)
  return jnp.maximum(jnp.min(jnp.broadcast_to(lo, q_positions.shape), axis=1), 0)


def skipping_range(variant: AttentionVariant) -> Optional[Callable]:
  """The variant's kv_range where a page walk that knows nothing of leading keys (a Pallas
  kernel's) may skip what lies outside it, else None: it would skip the sinks."""
  return None if variant.leading_keys else variant.kv_range


def _count(field: str, value, least: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < least:
    raise ValueError(f"{field} must be an int >= {least}, got {value!r}")
  return value


@functools.cache
def sliding_window(window: int) -> AttentionVariant:
  """A query at p sees keys j > p - window."""
  _count("window", window, 1)
  return AttentionVariant(f"window{window}", mask=lambda q, k: k > q - window, monotone=True,
                          kv_range=lambda q: (q - window + 1, q + 1))


@functools.cache
def sinks_window(sinks: int, window: int) -> AttentionVariant:
  """StreamingLLM: the first `sinks` keys and the last `window` ones."""
  _count("sinks", sinks, 0), _count("window", window, 1)
  return AttentionVariant(f"sinks{sinks}-window{window}", monotone=True,
                          mask=lambda q, k: (k < sinks) | (k > q - window),
                          kv_range=lambda q: (q - window + 1, q + 1), leading_keys=sinks)


@functools.cache
def soft_cap(cap: float) -> AttentionVariant:
  """Gemma 2's logit soft-cap: s -> cap * tanh(s / cap)."""
  if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
    raise ValueError(f"soft_cap must be a number > 0, got {cap!r}")
  return AttentionVariant(f"softcap{cap:g}", score=lambda s, q, k, h: cap * jnp.tanh(s / cap))


# The built-ins by name, as their records are named (get_variant, --attention).
_BUILT_INS = ((r"window(\d+)", lambda window: sliding_window(int(window))),
              (r"sinks(\d+)-window(\d+)",
               lambda sinks, window: sinks_window(int(sinks), int(window))),
              (r"softcap(\d+(?:\.\d+)?)", lambda cap: soft_cap(float(cap))))
BUILT_IN_NAMES = ("window<N>", "sinks<S>-window<W>", "softcap<C>")
