"""Where arrays live under tensor parallelism: the device mesh and the Megatron rules.

`make_mesh(tp, dp)` lays devices out as a ("data", "model") `jax.sharding.Mesh`;
a model lives on one data row (`submeshes`; kvjax/engine/router.py spreads replicas
over the rows).  Parameters are placed with `NamedSharding` by leaf name
(`param_spec`), the Megatron layout: q/k/v heads and gate/up columns split over
"model", o and down rows split (their partial sums are the two all-reduces of
a dense block), embedding and LM head split over the vocabulary, norms and
MLA's shared latent projection replicated.  A leaf this table does not name is
replicated: correct, only not split.

KV pages split over "model" by kv head (`cache_shardings`, from each cache's
`HEAD_AXES`).  When num_kv_heads K does not divide by tp, `replicate_kv_heads`
copies each kv head r times (K' = lcm(K, tp), r = K'/K) in wk/wv (and their
biases), an equivalent model whose K' heads split evenly: query head n still
reads a copy of kv head n // (N/K).  The cost, r x the KV bytes per token, is
logged here and reported by kvjax/parallel/ledger_tp.py `tp_plan`.  MLA's latent cache
has no head axis and is replicated; its query and output heads split.

The steps themselves need no change: jit propagates these shardings through
the model (GSPMD), and kvjax/attention/backends.py `on_mesh` runs the attention and
verification kernels per device under `shard_map`.

Expert parallelism: `make_mesh(tp, dp, ep)` with ep > 1 adds an "expert" axis
between "data" and "model" (why that order: kvjax/parallel/mesh_axes.py).  Everything
above keeps its "model" split and is replicated along "expert"; placement
stacks each MoE layer's routed experts (`split_experts`) and splits them
Ne / ep a device along "expert", each expert's width Fe along "model"
(kvjax/moe/expert_parallel.py `EXPERT_SPECS`).  On a mesh without the axis
(ep = 1) experts stay per-expert leaves, each one's Fe split over "model".
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.model.config import ModelConfig
from kvjax.moe.expert_parallel import EXPERT_SPECS, stack_experts
from kvjax.moe.params import MoEParams
from kvjax.parallel.mesh_axes import DATA, EXPERT, MODEL

__all__ = ["DATA", "EXPERT", "MODEL", "make_mesh", "submeshes", "tp_size", "ep_size", "mesh_of",
           "check_mesh", "replicated_kv_heads", "param_spec", "param_shardings", "split_experts",
           "init_on_mesh", "shard_params", "place_host_params", "replicate_kv_heads",
           "cache_shardings"]
_log = logging.getLogger(__name__)

# Leaf name -> (axis split over "model", what that axis counts).  "kv" leaves split
# only when K divides by tp (replicate_kv_heads makes it so); "vocab" only when V does.
_SPLIT = {
    "wq": (1, "heads"), "wk": (1, "kv"), "wv": (1, "kv"), "wo": (0, "heads"),
    "bq": (0, "heads"), "bk": (0, "kv"), "bv": (0, "kv"),
    "w_gate": (1, "ffn"), "w_up": (1, "ffn"), "w_down": (0, "ffn"),
    "b_gate": (0, "ffn"), "b_up": (0, "ffn"),
    "wk_b": (1, "heads"), "wv_b": (1, "heads"), "wq_b": (1, "heads"),
    "embed": (0, "vocab"), "lm_head": (1, "vocab"),
}


def _check_count(value, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  return int(value)


def make_mesh(tp: int = 1, dp: int = 1, ep: int = 1,
              devices: Optional[Sequence] = None) -> Mesh:
  """A (dp, tp) mesh with axes ("data", "model") over the first dp * tp `devices`
  (default: every device of every process, jax.devices()); with ep > 1 a (dp, ep, tp)
  mesh with axes ("data", "expert", "model") over the first dp * ep * tp."""
  tp, dp, ep = _check_count(tp, "tp"), _check_count(dp, "dp"), _check_count(ep, "ep")
  devices = list(jax.devices() if devices is None else devices)
  if tp * dp * ep > len(devices):
    asked = f"tp={tp} x dp={dp}" + (f" x ep={ep}" if ep > 1 else "")
    raise ValueError(f"{asked} needs {tp * dp * ep} devices, only {len(devices)} "
                     f"available ({devices[0].platform})")
  grid = np.array(devices[:tp * dp * ep])
  if ep == 1:
    return Mesh(grid.reshape(dp, tp), (DATA, MODEL))
  return Mesh(grid.reshape(dp, ep, tp), (DATA, EXPERT, MODEL))


def submeshes(mesh: Mesh) -> list[Mesh]:
  """One mesh per data row (data axis 1, the rest as `mesh`): where each data-parallel
  replica lives."""
  return [Mesh(row[None], mesh.axis_names) for row in mesh.devices]


def tp_size(mesh: Optional[Mesh]) -> int:
  return 1 if mesh is None else mesh.shape[MODEL]


def ep_size(mesh: Optional[Mesh]) -> int:
  return 1 if mesh is None or EXPERT not in mesh.axis_names else mesh.shape[EXPERT]


def mesh_of(params) -> Optional[Mesh]:
  """The mesh `params` were placed on by this module, or None (one device, or no
  params yet: options are checked before any weight is read)."""
  sharding = getattr(getattr(params, "embed", None), "sharding", None)
  if isinstance(sharding, NamedSharding) and MODEL in sharding.mesh.axis_names:
    return sharding.mesh
  return None


def replicated_kv_heads(num_kv_heads: int, tp: int) -> int:
  """The kv heads a tp-way cache stores: the smallest multiple of K that tp divides."""
  return math.lcm(num_kv_heads, tp)


def check_mesh(cfg: ModelConfig, mesh: Mesh) -> None:
  """ValueError naming the dimension unless cfg splits tp (and ep) ways on `mesh`."""
  tp, ep = tp_size(mesh), ep_size(mesh)
  if mesh.shape[DATA] != 1:
    raise ValueError(f"a model lives on one data row, got a mesh with data={mesh.shape[DATA]}; "
                     "put one model per kvjax.parallel.sharding.submeshes(mesh) behind "
                     "kvjax.Router")
  if cfg.num_heads % tp:
    raise ValueError(f"num_heads {cfg.num_heads} of {cfg.name!r} does not split over tp={tp}")
  if cfg.intermediate_size % tp:
    raise ValueError(f"intermediate_size {cfg.intermediate_size} of {cfg.name!r} does not "
                     f"split over tp={tp}")
  if cfg.attention_type != "mla" and cfg.num_heads % replicated_kv_heads(cfg.num_kv_heads, tp):
    raise ValueError(f"num_kv_heads {cfg.num_kv_heads} replicated to "
                     f"{replicated_kv_heads(cfg.num_kv_heads, tp)} for tp={tp} does not group "
                     f"num_heads {cfg.num_heads}")
  check_experts_split(cfg, ep)
  if cfg.num_experts and cfg.moe_intermediate_size % tp:
    raise ValueError(f"moe_intermediate_size {cfg.moe_intermediate_size} of {cfg.name!r} "
                     f"does not split over tp={tp}")


def check_experts_split(cfg: ModelConfig, ep: int) -> None:
  """ValueError naming the values unless cfg's routed experts split ep ways."""
  if ep > 1 and not cfg.num_experts:
    raise ValueError(f"ep={ep} splits routed experts, and {cfg.name!r} has none "
                     "(num_experts=0, a dense model); use ep=1")
  if cfg.num_experts % ep:
    raise ValueError(f"num_experts {cfg.num_experts} of {cfg.name!r} does not split over "
                     f"ep={ep}")


def param_spec(name: str, shape: tuple, tp: int) -> P:
  """The PartitionSpec of a parameter leaf called `name` with `shape` on a tp-way mesh."""
  if name not in _SPLIT or tp == 1:
    return P()
  axis, kind = _SPLIT[name]
  if kind in ("kv", "vocab") and shape[axis] % tp:
    return P()  # K < tp before replicate_kv_heads; a vocabulary tp does not divide
  if shape[axis] % tp:
    raise ValueError(f"parameter {name} {shape}: axis {axis} ({kind}) does not split over "
                     f"tp={tp}")
  return P(*([None] * axis + [MODEL]))


def _leaf_name(path) -> str:
  return next(str(key.name) for key in reversed(path) if hasattr(key, "name"))


def _stacked_expert(path) -> bool:
  """Whether `path` is a leaf of stacked experts (moe.experts.w_gate, not experts[e].w_gate)."""
  return len(path) > 1 and getattr(path[-2], "name", None) == "experts"


def param_shardings(params, mesh: Mesh):
  """A pytree like `params` (arrays or ShapeDtypeStructs) of NamedShardings."""
  tp = tp_size(mesh)

  def spec(path, x):
    if _stacked_expert(path):
      return EXPERT_SPECS[_leaf_name(path)]
    return param_spec(_leaf_name(path), x.shape, tp)

  return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, spec(path, x)),
                                          params)


def split_experts(params, mesh: Mesh, stack: Callable = jnp.stack):
  """params -> each MoE layer's experts stacked for `mesh`'s "expert" axis (`stack`:
  kvjax/moe/expert_parallel.py `stack_experts`); as is on a mesh without one."""
  if EXPERT not in mesh.axis_names:
    return params
  is_moe = lambda x: isinstance(x, MoEParams)
  return jax.tree.map(lambda x: stack_experts(x, mesh, stack) if is_moe(x) else x, params,
                      is_leaf=is_moe)


def init_on_mesh(init: Callable, mesh: Mesh, *args):
  """init(*args) -> params, run with its outputs placed shard by shard (args are passed,
  never closed over: a multi-process mesh cannot embed another process's shards); on
  an ep mesh with the experts stacked first (`split_experts`), inside the same program."""
  placed = lambda *a: split_experts(init(*a), mesh)
  shardings = param_shardings(jax.eval_shape(placed, *args), mesh)
  return jax.jit(placed, out_shardings=shardings)(*args)


def shard_params(params, mesh: Mesh):
  """Existing params (a Model built in Python) -> the same values in this layout."""
  return init_on_mesh(lambda tree: tree, mesh, params)


class _HostStack:
  """Ne host arrays (memory-mapped views) read as their stack [Ne, ...], one device's
  slice at a time: no whole copy."""

  def __init__(self, leaves):
    self.leaves, self.shape = leaves, (len(leaves),) + tuple(leaves[0].shape)

  def __getitem__(self, index):
    return np.stack([np.asarray(leaf[index[1:]]) for leaf in self.leaves[index[0]]])


def place_host_params(host_params, mesh: Mesh, dtype):
  """Host arrays (memory-mapped views) -> device arrays, each device reading its own slice
  (on an ep mesh: of its own experts)."""
  np_dtype = np.dtype(dtype)

  def place(x, sharding):
    return jax.make_array_from_callback(
        x.shape, sharding, lambda index: np.ascontiguousarray(x[index], np_dtype))

  host_params = split_experts(host_params, mesh, _HostStack)
  return jax.tree.map(place, host_params, param_shardings(host_params, mesh))


def _repeat_heads(params, repeats: int):
  def repeat(path, x):
    if x is None or _SPLIT.get(_leaf_name(path), (0, ""))[1] != "kv":
      return x
    return jnp.repeat(x, repeats, axis=_SPLIT[_leaf_name(path)][0])

  return jax.tree_util.tree_map_with_path(repeat, params)


def replicate_kv_heads(cfg: ModelConfig, params, mesh: Mesh):
  """(cfg, params) with K' = lcm(K, tp) kv heads when tp does not divide K (else as is).

  Logs what the replication costs: r x the KV cache's bytes per token.
  """
  tp, k = tp_size(mesh), cfg.num_kv_heads
  kv_heads = replicated_kv_heads(k, tp)
  if cfg.attention_type == "mla" or kv_heads == k:
    return cfg, params
  repeats = kv_heads // k
  _log.warning("num_kv_heads %d of %r does not split over tp=%d: each kv head is stored %dx "
               "(%d heads, one or more per device); the KV cache costs %dx its single-device "
               "bytes per token (kvjax.parallel.ledger_tp.tp_plan)", k, cfg.name, tp, repeats,
               kv_heads, repeats)
  params = init_on_mesh(functools.partial(_repeat_heads, repeats=repeats), mesh, params)
  return dataclasses.replace(cfg, num_kv_heads=kv_heads), params


def cache_shardings(cache, mesh: Mesh):
  """NamedShardings for a cache pytree (arrays or ShapeDtypeStructs): each field in its
  class's HEAD_AXES {name: kv-head axis} splits there over "model"; the rest replicate."""
  head_axes = getattr(type(cache), "HEAD_AXES", {})

  def spec(path, x):
    axis = head_axes.get(_leaf_name(path))
    if axis is None or x.shape[axis] % tp_size(mesh):
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(*([None] * axis + [MODEL])))

  return jax.tree_util.tree_map_with_path(spec, cache)
