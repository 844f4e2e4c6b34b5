"""Expert parallelism: each MoE layer's routed experts split over the mesh axis "expert".

On a mesh made with ep > 1 (kvjax.make_mesh: axes "data", "expert", "model";
kvjax/parallel/mesh_axes.py) placement (kvjax/parallel/sharding.py) runs `stack_experts` on every
MoE layer: its experts become one `ExpertParams` of [Ne, ...] leaves laid out
`EXPERT_SPECS`, so device (i, j) of the (expert, model) grid holds experts
i Ne / ep .. (i + 1) Ne / ep - 1 and, of each, the j-th 1 / tp of its width Fe:
each expert's weights are on tp devices, 1 / (ep tp) of all of them on each.
The MoE layer records the mesh (`MoEParams.mesh`), so jitted steps need no mesh
context.  The block (kvjax/moe/block.py) then runs `expert_parallel`:
activations are replicated along "expert" (attention stays tensor parallel over
"model"), so every device already holds every token and its routing; under
`shard_map` each device sorts the assignments that land on its local experts
first, runs them through `ragged_dot` over its [Ne / ep, D, Fe / tp] slices
(rows past the local groups are dropped), weighs them, and one `psum` over
("expert", "model") combines the partial sums (other experts' tokens, other
slices of Fe): one all-reduce of [Bt, D] per MoE layer, no all-to-all.  That
is the better trade while the tokens are already everywhere; a token-sharded
layout would dispatch with `jax.lax.ragged_all_to_all` instead.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from kvjax.moe.activation import SWIGLU, ExpertGLU
from kvjax.moe.grouped import ragged_expert_mlp
from kvjax.moe.params import ExpertParams, MoEParams
from kvjax.parallel.mesh_axes import EXPERT, MODEL
from kvjax.quant.qweight import QuantizedWeight

__all__ = ["EXPERT_SPECS", "stack_experts", "expert_parallel"]

# Each stacked leaf: [Ne] over "expert", an expert's width Fe over "model"; b_down [Ne, D]
# whole on every "model" slice (the slice with model index 0 adds it).
EXPERT_SPECS = {"w_gate": P(EXPERT, None, MODEL), "w_up": P(EXPERT, None, MODEL),
                "w_down": P(EXPERT, MODEL, None), "b_gate": P(EXPERT, MODEL),
                "b_up": P(EXPERT, MODEL), "b_down": P(EXPERT)}


def stack_experts(moe: MoEParams, mesh: Mesh, stack: Callable = jnp.stack) -> MoEParams:
  """The layer with its tuple of experts as one ExpertParams of [Ne, ...] leaves (`stack`
  of the Ne per-expert leaves: jnp.stack under jit, or a host view) for `mesh`; a layer
  already stacked as is."""
  if moe.mesh is not None:
    return moe
  if any(isinstance(w, QuantizedWeight) for w in (moe.experts[0].w_gate, moe.experts[0].w_up)):
    raise ValueError("expert parallelism (ep > 1) splits float experts; these are quantized "
                     "(weight_dtype): use ep=1")
  stacked = jax.tree.map(lambda *leaves: stack(leaves), *moe.experts)
  return moe.replace(experts=stacked, mesh=mesh)


def _local_experts(stacked: ExpertParams, x: jax.Array, weights: jax.Array,
                   chosen: jax.Array, glu: ExpertGLU) -> jax.Array:
  """One device's share: its [Ne / ep] experts' Fe / tp slices on the assignments routed
  to them."""
  local = stacked.w_gate.shape[0]
  first = jax.lax.axis_index(EXPERT) * local
  k = chosen.shape[1]
  ids = chosen.reshape(-1) - first  # [Ae] local expert id, or outside [0, local)
  mine = (ids >= 0) & (ids < local)
  order = jnp.argsort(jnp.where(mine, ids, local), stable=True)  # local ones first, by expert
  sizes = jnp.bincount(jnp.where(mine, ids, local), length=local + 1)[:local].astype(jnp.int32)
  if stacked.b_down is not None:  # whole on each Fe slice: added once, by slice 0
    stacked = stacked.replace(b_down=jnp.where(jax.lax.axis_index(MODEL) == 0,
                                               stacked.b_down, 0))
  # Rows past the local groups come out as their bias alone; `mine` drops them below.
  out = ragged_expert_mlp(stacked, x[order // k], ids[order], sizes, glu)
  out = jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], k, -1)
  partial = (out.astype(jnp.float32) * (weights * mine.reshape(weights.shape))[..., None]).sum(1)
  return jax.lax.psum(partial, (EXPERT, MODEL)).astype(x.dtype)


def expert_parallel(moe: MoEParams, x: jax.Array, weights: jax.Array, chosen: jax.Array,
                    glu: ExpertGLU = SWIGLU) -> jax.Array:
  """x [Bt, D], weights / chosen [Bt, Ke] -> [Bt, D]; `moe`'s experts stacked on its mesh."""
  specs = jax.tree_util.tree_map_with_path(lambda path, _: EXPERT_SPECS[path[-1].name],
                                           moe.experts)
  local = lambda *args: _local_experts(*args, glu)
  return jax.shard_map(local, mesh=moe.mesh, in_specs=(specs, P(), P(), P()), out_specs=P(),
                       check_vma=False)(moe.experts, x, weights, chosen)
