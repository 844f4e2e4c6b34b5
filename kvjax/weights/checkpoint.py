"""kvjax-native checkpoints with orbax.

A model directory holds
  config.json     the ModelConfig fields (JSON; rope_scaling as an object)
  metadata.json   free-form JSON (the default model keeps its model card here)
  params/         the Params pytree, orbax StandardCheckpointer format

`restore` needs nothing but the directory: the config rebuilds the abstract
Params tree that orbax restores into, so a fresh process can load it.
Training runs keep a separate orbax CheckpointManager of the whole TrainState
(`save_train_state` / `restore_train_state`) so a launcher can resume exactly.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from kvjax.model.config import ModelConfig, RopeScaling, YarnScaling
from kvjax.model.params import Params, init_params
from kvjax.parallel.sharding import ep_size, param_shardings, shard_params

__all__ = ["DEFAULT_MODEL_DIR", "config_to_dict", "config_from_dict", "save", "read_config",
           "restore", "read_metadata", "train_state_manager", "save_train_state",
           "restore_train_state"]

# The built-in byte-level code model shipped with the package (see its MODEL_CARD.md).
DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "assets", "default_model")


def config_to_dict(cfg: ModelConfig) -> dict:
  out = dataclasses.asdict(cfg.replace(attention_variant=None))  # a variant is code
  del out["attention_variant"]
  for field in ("layer_windows", "layer_rope_thetas"):
    if getattr(cfg, field) is not None:
      out[field] = list(getattr(cfg, field))
  return out


def config_from_dict(d: dict) -> ModelConfig:
  d = dict(d)
  scaling = d.get("rope_scaling")
  if scaling is not None:  # only YaRN's record has beta_fast
    d["rope_scaling"] = (YarnScaling if "beta_fast" in scaling else RopeScaling)(**scaling)
  return ModelConfig(**d)  # __post_init__ makes list fields tuples


def _abstract_params(cfg: ModelConfig, dtype, mesh=None) -> Params:
  """Restore target on this process's default device, or shard by shard on `mesh`
  (kvjax/parallel/sharding.py): a checkpoint written on a CPU must load on a GPU (orbax
  would otherwise ask for the saving topology)."""
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), dtype))
  shardings = (param_shardings(shapes, mesh) if mesh is not None else jax.tree_util.tree_map(
      lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), shapes))
  return jax.tree_util.tree_map(
      lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes,
      shardings)


def save(path: str, config: ModelConfig, params: Params,
         metadata: Optional[dict] = None) -> None:
  """Writes config.json, metadata.json and params/ under `path` (replacing params/)."""
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(path, "params"), params, force=True)
    ckptr.wait_until_finished()
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_dict(config), f, indent=2)
  with open(os.path.join(path, "metadata.json"), "w") as f:
    json.dump(metadata or {}, f, indent=2)


def read_metadata(path: str) -> dict:
  with open(os.path.join(path, "metadata.json")) as f:
    return json.load(f)


def read_config(path: str) -> ModelConfig:
  """The ModelConfig of the kvjax checkpoint at `path`, reading no tensor."""
  config_path = os.path.join(os.path.abspath(path), "config.json")
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"{os.path.abspath(path)} is not a kvjax checkpoint: no config.json")
  with open(config_path) as f:
    try:
      return config_from_dict(json.load(f))
    except (TypeError, ValueError) as error:  # bad JSON, unknown or bad ModelConfig fields
      raise ValueError(f"{config_path}: {error}") from None


def restore(path: str = DEFAULT_MODEL_DIR, dtype=None, mesh=None) -> tuple[ModelConfig, Params]:
  """-> (config, params); params cast to `dtype` (default: as stored), restored straight
  into their shardings on `mesh` if given (on an ep mesh the experts restore whole on
  each "expert" row, then move to their split: kvjax/parallel/sharding.py `shard_params`)."""
  path = os.path.abspath(path)
  cfg = read_config(path)
  params_dir = os.path.join(path, "params")
  stored_dtype = _stored_dtype(params_dir)
  target = _abstract_params(cfg, stored_dtype, mesh)
  # Partial: a checkpoint saved before Params grew an optional field (None for its
  # config, e.g. the gated-attention `wg`) has no entry for it.
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      params = ckptr.restore(params_dir, args=ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True))
  except Exception as error:  # orbax / TensorStore: a missing array, truncated data
    first_line = str(error).split("\n")[0][:300]
    raise ValueError(f"{params_dir}: the stored arrays do not restore into the Params "
                     f"{path}/config.json describes (missing, truncated or corrupt data?): "
                     f"{type(error).__name__}: {first_line}") from error
  if dtype is not None:
    params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
  if ep_size(mesh) > 1:  # restored per expert, whole along "expert": now stacked and split
    params = shard_params(params, mesh)
  return cfg, params


def _stored_dtype(params_dir: str):
  """The dtype the params were saved at, from orbax's metadata; a missing params/ or
  unreadable metadata raise naming the path and what is missing."""
  if not os.path.isdir(params_dir):
    raise FileNotFoundError(f"{params_dir} does not exist: a kvjax checkpoint holds "
                            "config.json, metadata.json and params/ (kvjax.weights.checkpoint"
                            ".save writes them)")
  with ocp.StandardCheckpointer() as ckptr:
    try:
      stored = ckptr.metadata(params_dir)
    except Exception as error:  # orbax's own parse errors
      raise ValueError(f"{params_dir}: orbax metadata unreadable: {error}") from error
  item = getattr(stored, "item_metadata", None)
  leaves = jax.tree_util.tree_leaves(getattr(item, "tree", None))
  if not leaves:
    raise ValueError(f"{params_dir}: no readable orbax tree metadata (its _METADATA file is "
                     "missing or garbled), so the stored arrays cannot be found")
  return leaves[0].dtype


def train_state_manager(directory: str, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """Orbax manager of TrainState checkpoints (plus a JSON of launcher progress)."""
  return ocp.CheckpointManager(
      os.path.abspath(directory), item_names=("state", "progress"),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))


def save_train_state(manager: ocp.CheckpointManager, step: int, state: Any,
                     progress: dict) -> None:
  """Blocks until written: the caller donates `state` to its next step."""
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress)))
  manager.wait_until_finished()


def restore_train_state(manager: ocp.CheckpointManager, target: Any):
  """-> (state, progress) of the latest step, or (target, None) when there is none."""
  step = manager.latest_step()
  if step is None:
    return target, None
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore()))
  return restored.state, restored.progress
