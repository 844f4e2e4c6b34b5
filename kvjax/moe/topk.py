"""Top-k expert choice that breaks ties as HF's oracle, torch.topk on CPU, does.

torch.topk runs libstdc++'s std::nth_element (k * 64 > n, as for Mixtral,
Qwen3-MoE and DeepSeek-V3) or std::partial_sort (k * 64 <= n: a heap select) on
(value, index) pairs compared by value alone: median-of-three pivots, Hoare
partitions and heap sifts move tied experts around, so which of two equal
scores is chosen depends on where they sit, neither "lower index first"
(jax.lax.top_k) nor any fixed rule.  Only the chosen *set* matters to the
output (weights are gathered per expert), and it can differ only when the k-th
and (k+1)-th scores tie; so `top_k_experts` takes jax.lax.top_k and, only in a
step where some row has such a boundary tie, replays libstdc++ on every row
(`lax.cond`).  The introselect replay stops partitioning at libstdc++'s depth
limit (2 log2 n) and insertion-sorts what is left, where libstdc++ would
heap-select; partitions that halve never get there (Hoare splits ties evenly).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["top_k_experts", "nth_element_order", "heap_select_order"]


def _swap(perm: jax.Array, i, j) -> jax.Array:
  pi, pj = perm[i], perm[j]
  return perm.at[i].set(pj).at[j].set(pi)


def _partition(vals: jax.Array, perm: jax.Array, first, last):
  """libstdc++ __unguarded_partition_pivot on perm[first:last] (larger = earlier) -> (perm, cut)."""
  v = lambda p, i: vals[p[i]]
  a, b, c = first + 1, first + (last - first) // 2, last - 1
  va, vb, vc = v(perm, a), v(perm, b), v(perm, c)
  median = jnp.where(va > vb, jnp.where(vb > vc, b, jnp.where(va > vc, c, a)),
                     jnp.where(va > vc, a, jnp.where(vb > vc, c, b)))
  perm = _swap(perm, first, median)
  pivot = v(perm, first)

  def step(state):
    perm, lo, hi, _ = state
    lo = lax.while_loop(lambda i: v(perm, i) > pivot, lambda i: i + 1, lo)
    hi = lax.while_loop(lambda i: pivot > v(perm, i), lambda i: i - 1, hi - 1)
    done = lo >= hi
    perm = jnp.where(done, perm, _swap(perm, lo, hi))
    return perm, jnp.where(done, lo, lo + 1), hi, done

  perm, cut, _, _ = lax.while_loop(lambda s: ~s[3], step, (perm, first + 1, last, False))
  return perm, cut


def _insertion_sort(vals: jax.Array, perm: jax.Array, first, last) -> jax.Array:
  """Stable insertion sort of perm[first:last] by descending value (libstdc++'s)."""

  def insert(i, perm):
    def shift(state):
      perm, j = state
      return _swap(perm, j, j - 1), j - 1

    active = (i > first) & (i < last)
    perm, _ = lax.while_loop(
        lambda s: active & (s[1] > first) & (vals[s[0][s[1]]] > vals[s[0][s[1] - 1]]),
        shift, (perm, i))
    return perm

  return lax.fori_loop(0, perm.shape[0], insert, perm)


def nth_element_order(vals: jax.Array, nth: int) -> jax.Array:
  """vals [n] -> the index order std::nth_element(begin, begin + nth, end, greater) leaves."""
  n = vals.shape[0]
  depth = 2 * (n.bit_length() - 1)

  def step(state):
    perm, first, last, depth = state
    perm, cut = _partition(vals, perm, first, last)
    first, last = jnp.where(cut <= nth, cut, first), jnp.where(cut <= nth, last, cut)
    return perm, first, last, depth - 1

  perm, first, last, _ = lax.while_loop(lambda s: (s[2] - s[1] > 3) & (s[3] > 0), step,
                                        (jnp.arange(n), 0, n, depth))
  return _insertion_sort(vals, perm, first, last)


def _adjust_heap(vals, perm, hole, size, value):
  """libstdc++ __adjust_heap + __push_heap on the heap perm[:size] (top: the smallest value),
  placing index `value` from `hole` down."""
  top = hole

  def down(state):
    perm, hole, _ = state
    child = 2 * (hole + 1)
    child = jnp.where(vals[perm[child]] > vals[perm[child - 1]], child - 1, child)
    return perm.at[hole].set(perm[child]), child, child

  perm, hole, child = lax.while_loop(lambda s: s[2] < (size - 1) // 2, down, (perm, hole, hole))
  last = (size % 2 == 0) & (child == (size - 2) // 2)
  perm = jnp.where(last, perm.at[hole].set(perm[jnp.minimum(2 * child + 1, size - 1)]), perm)
  hole = jnp.where(last, 2 * child + 1, hole)

  def up(state):
    perm, hole = state
    parent = (hole - 1) // 2
    return perm.at[hole].set(perm[parent]), parent

  perm, hole = lax.while_loop(
      lambda s: (s[1] > top) & (vals[s[0][(s[1] - 1) // 2]] > vals[value]), up, (perm, hole))
  return perm.at[hole].set(value)


def heap_select_order(vals: jax.Array, k: int) -> jax.Array:
  """vals [n] -> the index order std::partial_sort(begin, begin + k, end, greater) leaves in
  its first k (as a set; torch.topk takes this path when k * 64 <= n)."""
  n = vals.shape[0]

  def make(j, perm):
    parent = (k - 2) // 2 - j
    return _adjust_heap(vals, perm, parent, k, perm[parent]) if k > 1 else perm

  perm = lax.fori_loop(0, max((k - 2) // 2 + 1, 0), make, jnp.arange(n))

  def scan(i, perm):
    def pop(perm):
      value = perm[i]
      return _adjust_heap(vals, perm.at[i].set(perm[0]), 0, k, value)

    return lax.cond(vals[perm[i]] > vals[perm[0]], pop, lambda p: p, perm)

  return lax.fori_loop(k, n, scan, perm)


def top_k_experts(scores: jax.Array, k: int) -> jax.Array:
  """scores [Bt, Ne] -> the k chosen experts [Bt, Ke] int32, the set torch.topk chooses."""
  values, experts = lax.top_k(scores, min(k + 1, scores.shape[-1]))
  if k == scores.shape[-1]:
    return experts.astype(jnp.int32)
  boundary_tie = jnp.any(values[:, k - 1] == values[:, k])
  if k * 64 <= scores.shape[-1]:
    replay = lambda: jax.vmap(lambda row: heap_select_order(row, k)[:k])(scores)
  else:
    replay = lambda: jax.vmap(lambda row: nth_element_order(row, k - 1)[:k])(scores)
  return lax.cond(boundary_tie, replay, lambda: experts[:, :k]).astype(jnp.int32)
