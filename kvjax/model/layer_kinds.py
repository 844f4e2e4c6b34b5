"""Layer kinds and MLP kinds, each declared once as a spec record registered by name.

A layer kind (GQA attention, MLA, Gated DeltaNet, ...) says in one record how
its params are made (`init`), which cache layout keeps its state (`cache`:
"kv" for pages of K/V, "latent" for MLA's shared rows, "recurrent" for a
per-slot state) and how one step runs (`step`, typed below).  An MLP kind
(dense SwiGLU, a mixture of experts) does the same for the block's second half.
The decoder (kvjax/model/decoder.py) and the initializer (kvjax/model/params.py) only look
kinds up: `layer_kind(cfg, layer)` resolves the name through the registered
selectors, so a new kind is one module that calls `register_layer_kind` (and,
to be chosen, `register_selector`).  Docs: docs/EXTENDING.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

__all__ = ["LayerKind", "MLPKind", "register_layer_kind", "register_mlp_kind",
           "register_selector", "layer_kind", "mlp_kind", "layer_kind_name", "LAYER_KINDS",
           "MLP_KINDS"]

CACHE_LAYOUTS = ("kv", "latent", "recurrent")


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """One token mixer.

  init(cfg, key, dtype, std) -> its params pytree.
  step(cfg, params, h [B, T, D], positions [B, T], inv_freq, cache, layer, attend)
    -> (cache, out [B, T, D]); it reaches its cache only through `attend`
    (kvjax/model/decoder.py `Attend`): `attend.attention` for KV / latent layouts,
    `attend.linear` for recurrent ones.
  """
  name: str
  init: Callable
  step: Callable
  cache: str

  def __post_init__(self):
    if self.cache not in CACHE_LAYOUTS:
      raise ValueError(f"layer kind {self.name!r}: cache {self.cache!r} not in {CACHE_LAYOUTS}")


@dataclasses.dataclass(frozen=True)
class MLPKind:
  """The block's channel mixer: init(cfg, key, dtype, std, layer) -> params;
  apply(cfg, params, h [B, T, D]) -> [B, T, D]; a kind that routes tokens to experts
  also has routed(cfg, params, h) -> (the same, each token's experts [Bt, Ke])."""
  name: str
  init: Callable
  apply: Callable
  routed: Optional[Callable] = None


LAYER_KINDS: dict = {}
MLP_KINDS: dict = {}
# (priority, selector(cfg, layer) -> kind name or None) per registry; the highest priority
# that answers wins.
_SELECTORS: dict = {"layer": [], "mlp": []}


def register_layer_kind(kind: LayerKind) -> LayerKind:
  if kind.name in LAYER_KINDS and LAYER_KINDS[kind.name] is not kind:
    raise ValueError(f"layer kind {kind.name!r} is already registered")
  LAYER_KINDS[kind.name] = kind
  return kind


def register_mlp_kind(kind: MLPKind) -> MLPKind:
  if kind.name in MLP_KINDS and MLP_KINDS[kind.name] is not kind:
    raise ValueError(f"MLP kind {kind.name!r} is already registered")
  MLP_KINDS[kind.name] = kind
  return kind


def register_selector(selector: Callable[[Any, int], Optional[str]], priority: int = 0,
                      registry: str = "layer"):
  """A rule picking a kind of `registry` ("layer" or "mlp") for (cfg, layer), or None
  to pass; higher priority asks first."""
  selectors = _SELECTORS[registry]
  if all(s is not selector for _, s in selectors):
    selectors.append((priority, selector))
    selectors.sort(key=lambda entry: -entry[0])
  return selector


def _select(registry: str, kinds: dict, cfg, layer: int):
  for _, selector in _SELECTORS[registry]:
    name = selector(cfg, layer)
    if name is not None:
      if name not in kinds:
        raise ValueError(f"{registry} kind {name!r} is not registered; known: {sorted(kinds)}")
      return kinds[name]
  raise ValueError(f"no {registry} kind selected for layer {layer} of {cfg.name!r}")


def layer_kind_name(cfg, layer: int) -> str:
  """The registered kind of layer `layer` (MTP blocks count from num_layers)."""
  return layer_kind(cfg, layer).name


def layer_kind(cfg, layer: int) -> LayerKind:
  return _select("layer", LAYER_KINDS, cfg, layer)


def mlp_kind(cfg, layer: int) -> MLPKind:
  return _select("mlp", MLP_KINDS, cfg, layer)


def _builtin_layer(cfg, layer: int) -> str:
  """The kinds ModelConfig itself names: a hybrid's linear layers, MLA, else GQA."""
  if cfg.is_linear_layer(layer):
    return "gated_delta"
  return "mla" if cfg.attention_type == "mla" else "gqa"


register_selector(_builtin_layer, priority=-1)
register_selector(lambda cfg, layer: "swiglu", priority=-1, registry="mlp")
