"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) onto a loaded
model's adapter slots (kvjax/lora/weight.py).

`with_slots` wraps every projection an adapter may target in a LoraWeight with
`num_slots` zero slots of rank `max_rank` (fixed shapes: loading or unloading
an adapter recompiles nothing); `read_adapter` reads and checks one adapter
against the model; `set_slot` writes it into a slot (None clears the slot).
Supported: llama-family layers (GQA attention and a dense gated MLP on every
layer), targets q/k/v/o_proj and gate/up/down_proj, rank <= MAX_RANK,
`lora_alpha` scaling and rsLoRA; anything else is refused by name.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvjax.lora.weight import LoraWeight
from kvjax.model.config import ModelConfig
from kvjax.model.layer_kinds import layer_kind, mlp_kind
from kvjax.model.params import BlockParams, Params

__all__ = ["MAX_RANK", "TARGETS", "Adapter", "read_adapter", "with_slots", "set_slot"]

MAX_RANK = 64
# PEFT module name -> (the BlockParams field that holds it: "attn" or None for the block
# itself, the weight's field there, how many leading weight axes it contracts).
TARGETS = {"q_proj": ("attn", "wq", 1), "k_proj": ("attn", "wk", 1),
           "v_proj": ("attn", "wv", 1), "o_proj": ("attn", "wo", 2),
           "gate_proj": (None, "w_gate", 1), "up_proj": (None, "w_up", 1),
           "down_proj": (None, "w_down", 1)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])\.weight$")
# adapter_config.json fields that change what the adapter computes: value kvjax supports.
_UNSUPPORTED = {"fan_in_fan_out": False, "bias": "none", "use_dora": False,
                "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                "alpha_pattern": {}, "lora_bias": False}


@dataclasses.dataclass(frozen=True)
class Adapter:
  """One adapter, checked against its model: its rank and, per (layer, PEFT module), the
  float32 down-projection [I, rank] and up-projection times the scaling [rank, O]."""
  path: str
  rank: int
  weights: dict = dataclasses.field(repr=False)


def _check_family(cfg: ModelConfig) -> None:
  for layer in range(cfg.num_layers):
    kinds = (layer_kind(cfg, layer).name, mlp_kind(cfg, layer).name)
    if kinds != ("gqa", "swiglu"):
      raise ValueError(f"LoRA adapters need GQA attention and a dense gated MLP on every "
                       f"layer (llama family); layer {layer} is {kinds[0]!r} + {kinds[1]!r}")


def _read_config(path: str) -> dict:
  file = os.path.join(path, "adapter_config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no adapter_config.json in LoRA adapter directory {path!r}")
  with open(file) as f:
    config = json.load(f)
  if config.get("peft_type") != "LORA":
    raise ValueError(f"{file}: peft_type {config.get('peft_type')!r} is not 'LORA'")
  rank = config.get("r")
  if not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
    raise ValueError(f"{file}: r={rank!r}; kvjax serves LoRA ranks 1..{MAX_RANK}")
  for field, supported in _UNSUPPORTED.items():
    value = config.get(field)
    if value is not None and value != supported and (value or supported):
      raise ValueError(f"{file}: {field}={config[field]!r} is not supported "
                       f"(kvjax serves {field}={supported!r})")
  targets = config.get("target_modules")
  if not isinstance(targets, list):
    raise ValueError(f"{file}: target_modules must be a list of module names, got "
                     f"{targets!r}")
  unknown = sorted(set(targets) - set(TARGETS))
  if unknown:
    raise ValueError(f"{file}: target_modules {unknown} are not supported; use "
                     f"{sorted(TARGETS)}")
  return config


def _read_tensors(file: str) -> dict:
  """name -> array of a safetensors file; a corrupt file is a ValueError naming it."""
  from safetensors import SafetensorError, safe_open

  try:
    with safe_open(file, framework="flax") as f:  # "flax": bfloat16 tensors too
      return {key: f.get_tensor(key) for key in f.keys()}
  except (SafetensorError, ValueError, OSError) as error:
    raise ValueError(f"{file} is not a readable safetensors file: {error}") from None


def _weight(block: BlockParams, module: str):
  field, name, _ = TARGETS[module]
  return getattr(block.attn if field else block, name)


def read_adapter(path: str, cfg: ModelConfig, params: Params) -> Adapter:
  """Read and check the PEFT adapter in directory `path` for the model (cfg, params)."""
  _check_family(cfg)
  config = _read_config(path)
  rank = config["r"]
  alpha = config.get("lora_alpha", 8)
  scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
  file = os.path.join(path, "adapter_model.safetensors")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no adapter_model.safetensors in LoRA adapter directory {path!r}")
  halves = {}
  for key, tensor in _read_tensors(file).items():
    match = _KEY.match(key)
    if match is None or int(match[1]) >= cfg.num_layers or match[2] not in config[
        "target_modules"]:
      raise ValueError(f"{file}: tensor {key!r} is not a LoRA weight of a target module "
                       f"of this {cfg.num_layers}-layer model")
    halves[int(match[1]), match[2], match[3]] = np.asarray(tensor, np.float32)
  weights = {}
  for layer, module, half in sorted(halves):
    if half == "B":
      continue
    shape = _weight(params.blocks[layer], module).shape
    num_in = TARGETS[module][2]
    size_in, size_out = math.prod(shape[:num_in]), math.prod(shape[num_in:])
    down, up = halves[layer, module, "A"], halves.get((layer, module, "B"))
    if up is None or down.shape != (rank, size_in) or up.shape != (size_out, rank):
      raise ValueError(f"{file}: layer {layer} {module} lora_A / lora_B are "
                       f"{down.shape} / {None if up is None else up.shape}; this model "
                       f"needs ({rank}, {size_in}) / ({size_out}, {rank})")
    weights[layer, module] = (down.T, up.T * np.float32(scale))
  if not weights or len(weights) * 2 != len(halves):
    raise ValueError(f"{file}: no complete lora_A / lora_B pairs")
  return Adapter(path=path, rank=rank, weights=weights)


def _map_targets(params: Params, fn) -> Params:
  """params with fn(layer, module, weight) in place of every target projection."""
  blocks = []
  for layer, block in enumerate(params.blocks):
    new = {}
    for module, (field, name, _) in TARGETS.items():
      new.setdefault(field, {})[name] = fn(layer, module, _weight(block, module))
    attn = block.attn.replace(**new["attn"])
    blocks.append(block.replace(attn=attn, **new[None]))
  return params.replace(blocks=tuple(blocks))


def with_slots(params: Params, cfg: ModelConfig, num_slots: int,
               max_rank: int = MAX_RANK) -> Params:
  """params with every target projection a LoraWeight of `num_slots` zero slots (slot 0
  stays the no-adapter slot) of rank `max_rank`."""
  _check_family(cfg)
  if num_slots < 2 or not 1 <= max_rank <= MAX_RANK:
    raise ValueError(f"LoRA slots need num_slots >= 2 (slot 0: no adapter) and max_rank in "
                     f"1..{MAX_RANK}, got {num_slots}, {max_rank}")

  def wrap(layer, module, w):
    num_in = TARGETS[module][2]
    size_in, size_out = math.prod(w.shape[:num_in]), math.prod(w.shape[num_in:])
    columns = (num_slots - 1) * max_rank
    return LoraWeight(base=w, a=jnp.zeros((size_in, columns), jnp.float32),
                      b=jnp.zeros((columns, size_out), jnp.float32), rank=max_rank)

  return _map_targets(params, wrap)


def set_slot(params: Params, slot: int, adapter: Optional[Adapter]) -> Params:
  """params (from with_slots) with `adapter` in slot `slot` >= 1 (None: zeros)."""

  def write(layer, module, w: LoraWeight):
    num_slots, max_rank = w.num_slots, w.rank
    if not 1 <= slot < num_slots:
      raise ValueError(f"LoRA slot {slot} is not in 1..{num_slots - 1}")
    down = np.zeros((w.a.shape[0], max_rank), np.float32)  # [I, Ra]
    up = np.zeros((max_rank, w.b.shape[1]), np.float32)  # [Ra, O]
    if adapter is not None and (layer, module) in adapter.weights:
      if adapter.rank > max_rank:
        raise ValueError(f"LoRA adapter {adapter.path!r} has rank {adapter.rank}; the slots "
                         f"hold rank <= {max_rank}")
      a, b = adapter.weights[layer, module]
      down[:, :adapter.rank], up[:adapter.rank] = a, b
    columns = slice((slot - 1) * max_rank, slot * max_rank)
    return w.replace(a=w.a.at[:, columns].set(down), b=w.b.at[columns].set(up))

  return _map_targets(params, write)
