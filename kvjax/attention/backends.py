"""Backends as capability records, chosen by name.

A `Backend` says what one implementation can do; caches and the speculative
step call through it and never compare functions by identity:
  attention(q [B, T, N, H], k_pages, v_pages [L, K, P, Z, H], batch: StepBatch, *, layer,
            sm_scale, k_scales=None, v_scales=None, variant=None)
      -> [B, T, N, H]    layer `layer` of every layer's float or int8 pages (scales
                         [L, K, P, Z] f32 with int8): given whole, so a loop inside
                         reads the layer in place instead of a copy of its pool;
                         `variant`: the layer's attention variant (below)
  verify(draft_tokens [B, J], draft_probs [B, J, V], target_logits [B, J+1, V],
         num_draft [B], keys [B], *, temperature [B]) -> (tokens [B, J+1], accepted [B])
      the whole batch at once, one PRNG key per row (claim C10)
  mla_attention(q [B, T, N, R + Hr], pages [L, P, Z, R + Hr], batch, *, layer, value_dim,
                sm_scale, variant=None) -> [B, T, N, R], or None: cannot read
                MLA's latent pages
  delta_rule(q, k [B, T, Nv, Hk], v [B, T, Nv, Hv], g, beta [B, T, Nv], state
             [B, Nv, Hk, Hv], chunk, capture [B, Y] or None) -> (o [B, T, Nv, Hv],
             state, states after the captured columns [B, Y, Nv, Hk, Hv] or None)
      a hybrid's Gated DeltaNet rule, float32 (every built-in: the jnp reference,
      kvjax/attention/gated_delta.py; a Pallas kernel would go here)
  gathered_attention(q [B, T, N, H], keys_t [K, B, H, S], values [K, B, S, H], batch, *,
            page_size, sm_scale, variant=None) -> [B, T, N, H]    or None
      attention over rows' K/V already gathered out of their float pages (row b's
      positions 0..S-1): a backend whose `attention` is that gather plus this
      sets it, and a device loop of decode steps over fixed rows (a multi-step
      burst, kvjax.generate's decode loop) then gathers once instead of every
      layer of every step (kvjax/caches/gathered.py).  None (kernels that read
      pages in place): every step reads pages through `attention`.  A variant
      that replaces `attention` of a record that has it replaces it too (or
      sets None), or bursts bypass the new `attention`.  page_size: the pages' Z
      (a batch-invariant record walks the copy in its fixed blocks of whole pages).
  variants: `attention` and `gathered_attention` apply the `variant=` they are given
      (an attention variant, kvjax/attention/variants.py: its mask, score and kv_range;
      the Pallas kernels trace them per tile; on a mesh each device's score sees global
      head indices).  A layer's variant is its model window and its attention= variant
      together (`layer_variant`), so every record's functions take `variant=`: a model
      with a sliding window passes one.  False: attention= variants are refused, never
      served as if there were none (the model's own windows still come as variants).
  prefill_full_width: a prefill chunk's `attention` (and `mla_attention`) reads each
      row's pages only as far as its kv_lens, whatever the block table's width (the
      reference backend walks blocks, kvjax/attention/blocked.py; the ragged kernels
      stop at kv_lens), so the packing gives prefill chunks the widest table and
      compiles one program per chunk shape (kvjax/engine/sched/batching.py).  False (the default
      of a new record): prefill tables are bucketed by width too.
  kv_dtypes: the page stores its `attention` reads (the model dtype always); a KV
      layout names the store it needs in its `check_backend` (kvjax/caches/layout.py),
      the backend never inspects layouts.  int4 (KIVI) pages are dequantized by
      their cache and attended densely, so "int4" in kv_dtypes means the backend
      accepts that path; a layout that reads its pages itself (attention sinks +
      window) asks nothing of the backend.

Built-in names:
  reference         kvjax's pure-jnp gather and pallas_kernels' jnp verifier (any device)
  pallas            pallas_kernels' ragged paged attention and fused rejection
                    sampler, compiled for the GPU
  pallas_interpret  the same kernels in interpret mode (CPU tests)
  pallas_reference  pallas_kernels' own jnp references of both contracts
A researcher's variant is a record too, passed where a name goes
(`Engine(model, backend=Backend(...))`, `kvjax.generate(..., backend=...)`), or
`dataclasses.replace(get_backend("reference"), name=..., attention=...)`;
nothing global is mutated.  Records are hashable (jit static arguments).
`on_mesh(record, mesh)` is the record for a tensor-parallel model: its kernels
run per device under shard_map (kvjax/parallel/sharding.py's kv-head split).
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Callable, Optional, Union

import jax
from jax.sharding import Mesh, PartitionSpec as P

import pallas_kernels
from kvjax.attention.gated_delta import delta_rule
from kvjax.attention.mla import mla_paged_attention
from kvjax.attention.paged import gathered_attention, gathered_blocks_attention, paged_attention
from kvjax.attention.variants import skipping_range
from kvjax.parallel.sharding import MODEL

__all__ = ["Backend", "BACKENDS", "get_backend", "backend_names", "on_mesh", "invariant"]


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  attention: Callable
  verify: Callable
  kv_dtypes: tuple = ("fp32", "bf16", "fp16", "int8")
  mla_attention: Optional[Callable] = None
  gathered_attention: Optional[Callable] = None
  delta_rule: Callable = delta_rule
  prefill_full_width: bool = False
  variants: bool = False
  mesh: Optional[Mesh] = None  # set by on_mesh: the kernels run per device of this mesh
  # Step programs on this record trace batch-invariant math (kvjax/model/invariance.py; set by
  # `invariant`).
  batch_invariant: bool = False

  def check_kv_dtype(self, kv_dtype: Optional[str]) -> None:
    """ValueError naming the backend unless it reads pages stored as kv_dtype."""
    if kv_dtype is not None and kv_dtype not in self.kv_dtypes:
      raise ValueError(f"kv_dtype {kv_dtype!r} is not supported by attention backend "
                       f"{self.name!r}; it reads {self.kv_dtypes}")

  def check_variants(self, names: tuple) -> None:
    """ValueError naming the backend and the variants unless it applies them."""
    if names and not self.variants:
      raise ValueError(f"attention backend {self.name!r} does not apply attention variants "
                       f"(attention={', '.join(names)}) yet; use backend='reference'")

  def check_mla(self) -> None:
    if self.mla_attention is None:
      raise ValueError(f"attention backend {self.name!r} cannot read MLA latent pages; use "
                       f"one with mla_attention (built in: 'reference')")


def _padded_reference(q, k_pages, v_pages, batch, **kwargs):
  return paged_attention(q, k_pages, v_pages, batch.kv_lens, batch.block_tables,
                         q_lens=batch.q_lens, **kwargs)


def _gathered_reference(q, keys_t, values, batch, *, page_size, **kwargs):
  del page_size  # the whole width at once
  return gathered_attention(q, keys_t, values, batch.kv_lens, **kwargs)


def _gathered_blocks(q, keys_t, values, batch, **kwargs):
  return gathered_blocks_attention(q, keys_t, values, batch.kv_lens, batch.q_lens, **kwargs)


def _padded_mla(q, pages, batch, **kwargs):
  return mla_paged_attention(q, pages, batch.kv_lens, batch.block_tables, q_lens=batch.q_lens,
                             **kwargs)


def _ragged(kernel: Callable, skips_pages: bool = True) -> Callable:
  """Padded [B, T] rows -> the ragged kernel's flattened [B*T] layout (cu_q_lens = b*T);
  an attention variant -> the kernel's position rules (its kv_range only where the kernel
  skips pages)."""

  def attention(q, k_pages, v_pages, batch, *, layer, k_scales=None, v_scales=None,
                variant=None, **kwargs):
    b, t, n, h = q.shape
    scales = {} if k_scales is None else dict(k_scales=k_scales[layer], v_scales=v_scales[layer])
    if variant is not None:
      kwargs = dict(kwargs, mask_fn=variant.mask, score_fn=variant.score)
      if skips_pages:
        kwargs["kv_range_fn"] = skipping_range(variant)
    out = kernel(q.reshape(b * t, n, h), k_pages[layer], v_pages[layer], batch.kv_lens,
                 batch.block_tables, batch.cu_q_lens, **scales, **kwargs)
    return out.reshape(b, t, n, h)

  return attention


BACKENDS = types.MappingProxyType({
    "reference": Backend(
        "reference", _padded_reference, pallas_kernels.rejection_sample_reference,
        kv_dtypes=("fp32", "bf16", "fp16", "int8", "int4"), mla_attention=_padded_mla,
        gathered_attention=_gathered_reference, prefill_full_width=True, variants=True),
    "pallas": Backend(
        "pallas", _ragged(pallas_kernels.ragged_paged_attention),
        pallas_kernels.rejection_sample, prefill_full_width=True, variants=True),
    "pallas_interpret": Backend(
        "pallas_interpret",
        _ragged(functools.partial(pallas_kernels.ragged_paged_attention, interpret=True)),
        functools.partial(pallas_kernels.rejection_sample, interpret=True),
        prefill_full_width=True, variants=True),
    "pallas_reference": Backend(
        "pallas_reference",
        _ragged(pallas_kernels.ragged_paged_attention_reference, skips_pages=False),
        pallas_kernels.rejection_sample_reference, variants=True),
})


def _global_heads(variant, local_heads: int):
  """variant whose score sees this device's query heads by their global index: under
  shard_map a device holds heads [i * local_heads, (i + 1) * local_heads) of the mesh's
  model axis and indexes them from 0.  Traced inside the shard_map body."""
  if variant.score is None:
    return variant
  offset = jax.lax.axis_index(MODEL) * local_heads
  score = variant.score
  return dataclasses.replace(variant, score=lambda s, q, k, h: score(s, q, k, h + offset))


@functools.lru_cache(maxsize=None)
def on_mesh(backend: Backend, mesh: Optional[Mesh]) -> Backend:
  """`backend` with its kernels run per device under shard_map on a tensor-parallel mesh.

  Each device attends its own kv heads' pages with its query heads (the kv
  head split of kvjax/parallel/sharding.py), or, for MLA, every head group reads the
  replicated latent pages; verification sees whole (replicated) rows.  Cached,
  so one mesh gives one record and a jitted step compiles once.
  """
  if mesh is None or backend.mesh is mesh:
    return backend
  if backend.mesh is not None:
    raise ValueError(f"backend {backend.name!r} already runs on another mesh")
  heads, pages, whole = P(None, None, MODEL, None), P(None, MODEL), P()  # pages [L, K, ...]

  def attention(q, k_pages, v_pages, batch, *, layer, sm_scale, variant=None, **scales):
    def local(q, k_pages, v_pages, batch, scales):
      options = {} if variant is None else dict(variant=_global_heads(variant, q.shape[2]))
      return backend.attention(q, k_pages, v_pages, batch, layer=layer, sm_scale=sm_scale,
                               **scales, **options)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, pages, pages, whole, pages),
                         out_specs=heads, check_vma=False)(q, k_pages, v_pages, batch, scales)

  def mla_attention(q, latent_pages, batch, **kwargs):
    local = lambda q, latent_pages, batch: backend.mla_attention(q, latent_pages, batch,
                                                                 **kwargs)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, whole, whole), out_specs=heads,
                         check_vma=False)(q, latent_pages, batch)

  def verify(*args, **kwargs):
    local = lambda args, kwargs: backend.verify(*args, **kwargs)
    return jax.shard_map(local, mesh=mesh, in_specs=whole, out_specs=whole,
                         check_vma=False)(args, kwargs)

  return dataclasses.replace(
      backend, name=f"{backend.name}@tp{mesh.shape[MODEL]}", attention=attention,
      verify=verify, mla_attention=backend.mla_attention and mla_attention,
      gathered_attention=None,  # sharded pages are read per device, per step
      mesh=mesh)


@functools.lru_cache(maxsize=None)
def invariant(backend: Backend) -> Backend:
  """backend's batch-invariant record (EngineConfig(batch_invariant=True)): its steps run
  kvjax/model/invariance.py's fixed-tile math, and decode loops walk their gathered copy in
  the fixed blocks a step reads its pages in (kvjax/attention/paged.py
  gathered_blocks_attention).  Only the reference backend's
  attention has the fixed-order form; ValueError naming any other.  Cached: one record,
  one compile per program."""
  if backend.batch_invariant:
    return backend
  if backend.attention is not _padded_reference:
    raise ValueError(f"batch_invariant needs backend 'reference' (its attention walks keys "
                     f"in a fixed order), got {backend.name!r}")
  return dataclasses.replace(backend, name=f"{backend.name}+invariant",
                             gathered_attention=_gathered_blocks, batch_invariant=True)


def backend_names() -> list[str]:
  return sorted(BACKENDS)


def get_backend(backend: Union[str, Backend]) -> Backend:
  """A built-in record by name, or the record itself; ValueError naming unknown names."""
  if isinstance(backend, Backend):
    return backend
  if backend not in BACKENDS:
    raise ValueError(f"unknown attention backend {backend!r}; known: {backend_names()} "
                     "or a kvjax.attention.backends.Backend record")
  return BACKENDS[backend]
