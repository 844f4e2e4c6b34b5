"""Expert parallelism: each MoE layer's routed experts split over a mesh axis "expert".

`shard_experts(params, mesh)` stacks every MoE layer's experts into one
`ExpertParams` with a leading [Ne] axis placed `P("expert")`: device i holds
experts i Ne / ep .. (i + 1) Ne / ep - 1, nothing else of them.  The block
(kvjax/moe/block.py) then runs `expert_parallel`: activations are replicated
(attention stays data / tensor parallel), so every device already holds every
token and its routing; under `shard_map` each device sorts the assignments
that land on its local experts first, runs them through `ragged_dot` over its
[Ne / ep, D, Fe] (rows past the local groups are dropped), weighs them, and
one `psum` over "expert" combines the devices' partial sums: one all-reduce of
[Bt, D] per MoE layer, no all-to-all.  That is the better trade while the
tokens are already everywhere; a token-sharded layout would dispatch with
`jax.lax.ragged_all_to_all` instead.  Calls run inside `jax.set_mesh(mesh)`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from kvjax.moe.activation import SWIGLU, ExpertGLU
from kvjax.moe.grouped import ragged_expert_mlp
from kvjax.moe.params import ExpertParams, MoEParams

__all__ = ["EXPERT", "shard_experts", "expert_parallel"]

EXPERT = "expert"


def shard_experts(params, mesh: jax.sharding.Mesh):
  """params (a Params pytree) -> the same model, each MoE layer's experts stacked and
  split over `mesh`'s "expert" axis; the rest replicated on the mesh."""
  ep = mesh.shape[EXPERT]
  replicated = NamedSharding(mesh, P())
  split = NamedSharding(mesh, P(EXPERT))

  def place(moe: MoEParams) -> MoEParams:
    if len(moe.experts) % ep:
      raise ValueError(f"{len(moe.experts)} experts do not split over ep={ep} devices")
    stacked = jax.tree.map(lambda *leaves: jax.device_put(jnp.stack(leaves), split),
                           *moe.experts)
    rest = jax.tree.map(lambda x: jax.device_put(x, replicated), moe.replace(experts=()))
    return rest.replace(experts=stacked)

  is_moe = lambda x: isinstance(x, MoEParams)
  placed = jax.tree.map(lambda x: place(x) if is_moe(x) else jax.device_put(x, replicated),
                        params, is_leaf=is_moe)
  return placed


def _local_experts(stacked: ExpertParams, x: jax.Array, weights: jax.Array,
                   chosen: jax.Array, glu: ExpertGLU) -> jax.Array:
  """One device's share: its [Ne / ep] experts on the assignments routed to them."""
  local = stacked.w_gate.shape[0]
  first = jax.lax.axis_index(EXPERT) * local
  k = chosen.shape[1]
  ids = chosen.reshape(-1) - first  # [Ae] local expert id, or outside [0, local)
  mine = (ids >= 0) & (ids < local)
  order = jnp.argsort(jnp.where(mine, ids, local), stable=True)  # local ones first, by expert
  sizes = jnp.bincount(jnp.where(mine, ids, local), length=local + 1)[:local].astype(jnp.int32)
  # Rows past the local groups come out as their bias alone; `mine` drops them below.
  out = ragged_expert_mlp(stacked, x[order // k], ids[order], sizes, glu)
  out = jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], k, -1)
  partial = (out.astype(jnp.float32) * (weights * mine.reshape(weights.shape))[..., None]).sum(1)
  return jax.lax.psum(partial, EXPERT).astype(x.dtype)


def expert_parallel(stacked: ExpertParams, x: jax.Array, weights: jax.Array,
                    chosen: jax.Array, glu: ExpertGLU = SWIGLU) -> jax.Array:
  """x [Bt, D], weights / chosen [Bt, Ke] -> [Bt, D]; `stacked` split over "expert"."""
  specs = jax.tree.map(lambda _: P(EXPERT), stacked)
  local = lambda *args: _local_experts(*args, glu)
  return jax.shard_map(local, in_specs=(specs, P(), P(), P()), out_specs=P(),
                       check_vma=False)(stacked, x, weights, chosen)
