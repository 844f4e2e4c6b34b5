"""KV layouts as spec records, registered by name: the one place a layout is declared.

A `KVLayout` says everything the rest of kvjax needs about one way of storing
K/V (float pages, int8, KIVI int4, MLA latents):
  arrays(cfg, store, sizes) -> {field: ArraySpec}   every array of its cache, with
      its shape, stored dtype and role ("page": pages on axis PAGE_AXIS, tokens on
      the next; "slot": slots on axis 1), so the pool is allocated from it
      (kvjax/caches/__init__.py) and the ledger and `kvjax memory` count bytes from
      it (kvjax/parallel/ledger.py): no second formula anywhere;
  cache: the pytree class built from those arrays; its `attend` is the layout's
      attention (the contract in kvjax/caches/__init__.py);
  capabilities: which backends read it (`check_backend`), whether a hybrid's
      recurrent state rides along (`hybrid`), a contiguous twin (`contiguous`),
      what it refuses (speculation, token-mode prefix hits: the reason, or None),
      whether a prefill chunk may take the widest block table (`prefill_full_width`);
  release: its host-side manager, the `PageRelease` of a request (which logical
      pages no future query reads, so the scheduler may free them).
A layout module registers its records at import (`register`); the package
imports every module in kvjax/caches/, so a new layout is one new file.
A record may also be passed where a name goes (`kv_dtype=KVLayout(...)`).  A record
with a `variant` is an alias: pages of another layout whose every layer runs that
attention variant (kvjax/attention/variants.py; "streaming" is the float pages under
StreamingLLM's sinks + window), applied to the model by `with_layout_variant`.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Callable, Optional, Sequence, Union

import jax.numpy as jnp

from kvjax.attention.backends import Backend
from kvjax.attention.variants import AttentionVariant
from kvjax.model.config import ModelConfig, short_dtype_name

__all__ = ["ArraySpec", "PoolSizes", "KVLayout", "PageRelease", "WindowRelease", "register",
           "layout_names", "get_layout", "sizing_layout", "with_layout_variant", "FLOAT_STORES",
           "STORE_DTYPES", "store_name", "allocate"]

# Stored dtypes of cache arrays by short name (kvjax/model/config.py's vocabulary).
FLOAT_STORES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
STORE_DTYPES = {**FLOAT_STORES, "int8": jnp.int8}


def store_name(dtype) -> str:
  """A jnp dtype (the model's) -> its short name ('bf16')."""
  return next(name for name, d in STORE_DTYPES.items() if jnp.dtype(d) == jnp.dtype(dtype))


@dataclasses.dataclass(frozen=True)
class ArraySpec:
  """One cache array: shape, stored dtype (short name), role ("page" or "slot"), whether
  it holds quantization scales (the ledger reports those apart), initial value."""

  shape: tuple
  dtype: str
  role: str = "page"
  scales: bool = False
  fill: int = 0

  @property
  def size(self) -> int:
    size = 1
    for dim in self.shape:
      size *= dim
    return size

  @property
  def nbytes(self) -> int:
    return self.size * jnp.dtype(STORE_DTYPES[self.dtype]).itemsize

  def allocate(self):
    return jnp.full(self.shape, self.fill, STORE_DTYPES[self.dtype])


def allocate(specs: dict) -> dict:
  """{field: ArraySpec} -> {field: its initial array} (distinct buffers: all are donated)."""
  return {field: spec.allocate() for field, spec in specs.items()}


@dataclasses.dataclass(frozen=True)
class PoolSizes:
  """What a pool is sized by: P pages of Z tokens, M slots, cache layers with MTP or not
  (and a hybrid's state snapshots and verify states)."""

  num_pages: int
  page_size: int
  num_slots: int
  with_mtp: bool = False
  num_snapshots: int = 0  # a hybrid's prefix-cache state snapshots (Q)
  num_verify_states: int = 0  # a hybrid's states per slot for speculation (J + 1)


@dataclasses.dataclass(frozen=True)
class PageRelease:
  """Host-side page manager of a layout: `dead_pages(start)` are the logical pages no
  query at a position >= start reads (freed, their block-table entries the null page), in
  increasing order: a range, or a tuple where live pages lie between dead ones (a mask's
  release, kvjax/engine/sched/mask_release.py); `max_pages_held` bounds what a request holds at
  once.  This base keeps every page."""

  page_size: int

  def dead_pages(self, start: int) -> Sequence[int]:
    return range(0)

  def max_pages_held(self, num_tokens: int, max_num_batched_tokens: int) -> int:
    """Most pages a request of num_tokens (prompt + max_new_tokens) holds at once."""
    return -(-(num_tokens - 1) // self.page_size)  # the last token is never fed


@dataclasses.dataclass(frozen=True)
class WindowRelease(PageRelease):
  """A sliding window (every layer's): a query at p sees keys j > p - window, so pages
  wholly before start - window + 1 are dead (kvjax/engine/sched/scheduler.py's module doc)."""

  window: Optional[int] = None

  def dead_pages(self, start: int) -> range:
    if self.window is None:
      return range(0)
    return range(max(0, start - self.window + 1) // self.page_size)

  def max_pages_held(self, num_tokens: int, max_num_batched_tokens: int) -> int:
    pages = super().max_pages_held(num_tokens, max_num_batched_tokens)
    if self.window is None:
      return pages
    # A row writes n <= max_num_batched_tokens positions: ceil((window + n - 2) / Z) + 1 pages.
    span = self.window + max_num_batched_tokens - 2
    return min(pages, -(-span // self.page_size) + 1)


def _window_release(page_size: int, window: Optional[int], **options) -> PageRelease:
  return WindowRelease(page_size, window)


def _any_backend(backend: Backend) -> None:
  del backend  # the cache reads its pages itself


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """One KV layout (module doc).  `store`: the float dtype pages keep (None: the model's);
  `attention`: the ModelConfig.attention_type it serves, `default` for that type when
  kv_dtype is None."""

  name: str
  arrays: Callable  # (cfg, store: str, sizes: PoolSizes) -> {field: ArraySpec}
  cache: type
  store: Optional[str] = None
  attention: str = "gqa"
  default: bool = False
  check_backend: Callable = _any_backend  # ValueError naming the backend that cannot read it
  hybrid: bool = False  # a hybrid's recurrent state may ride beside it (caches/recurrent.py)
  contiguous: Optional[Callable] = None  # (cfg, num_slots, max_len, dtype, **options) -> twin
  no_speculation: Optional[str] = None  # why drafts cannot be verified on it (None: they can)
  no_token_prefix: Optional[str] = None  # why prefix_match="token" cannot resume on it
  release: Callable = _window_release  # (page_size, model window, **options) -> PageRelease
  check_model: Callable = lambda cfg: None  # ValueError for a model it cannot serve
  options: tuple = ()  # (field, value) pairs: static fields of its cache (e.g. a window)
  # Its attention goes through the backend's, so a prefill chunk reads only as far as its
  # rows' lengths where the backend's does (Backend.prefill_full_width); False: it reads
  # every table column itself, and the packing keeps prefill tables bucketed by width.
  prefill_full_width: bool = False
  # Its caches take an attention variant (kvjax/attention/variants.py) in `attend` and
  # apply its mask and score (through the backend or by themselves); False: refused.
  variants: bool = False
  # An alias's attention variant, run on every layer of the model it serves (module doc).
  variant: Optional[AttentionVariant] = None

  def create(self, cfg: ModelConfig, sizes: PoolSizes, dtype):
    """The empty cache for cfg (model dtype `dtype`) sized by `sizes`."""
    specs = self.arrays(cfg, self.store or store_name(dtype), sizes)
    return self.cache(**allocate(specs), **self.static_fields(cfg))

  def page_release(self, page_size: int, window: Optional[int]) -> PageRelease:
    """The host-side manager for pages of `page_size` tokens under the model's widest
    window (None: some layer sees everything)."""
    return self.release(page_size, window, **dict(self.options))

  def create_contiguous(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype):
    """The contiguous twin: every slot reserves max_len tokens (at `dtype`)."""
    if self.contiguous is None:
      raise ValueError(f"kv_dtype {self.name!r} needs cache='paged', got cache='contiguous'")
    return self.contiguous(cfg, num_slots, max_len, dtype, **dict(self.options))

  def bytes_per_layer_token(self, cfg: ModelConfig, page_size: int, scales: bool = False,
                            store: str = "bf16") -> Fraction:
    """Page bytes per cache layer and token (pages of page_size tokens): values, or with
    `scales` the quantization scales.  `store`: the model dtype where the layout has none."""
    specs = self.arrays(cfg, self.store or store, PoolSizes(1, page_size, 1))
    return sum((Fraction(a.nbytes, page_size * cfg.cache_layers(False)) for a in specs.values()
                if a.role == "page" and a.scales == scales), Fraction(0))

  def values_per_layer_token(self, cfg: ModelConfig, page_size: int) -> Fraction:
    """Values (elements) of its page arrays per cache layer and token, scales aside."""
    specs = self.arrays(cfg, self.store or "fp32", PoolSizes(1, page_size, 1))
    return sum((Fraction(a.size, page_size * cfg.cache_layers(False)) for a in specs.values()
                if a.role == "page" and not a.scales), Fraction(0))

  def slot_bytes(self, cfg: ModelConfig, page_size: int, store: str = "bf16") -> int:
    """Bytes of one slot's arrays (a constant per request, e.g. int4's residual)."""
    specs = self.arrays(cfg, self.store or store, PoolSizes(1, page_size, 1))
    return sum(a.nbytes for a in specs.values() if a.role == "slot")

  def serving_config(self, cfg: ModelConfig) -> ModelConfig:
    """cfg as this layout serves it: with the alias's attention variant on every layer;
    ValueError if cfg runs another variant (one rule of what a query sees)."""
    if self.variant is None or cfg.attention_variant == self.variant:
      return cfg
    if cfg.attention_variant is not None:
      raise ValueError(f"kv_dtype {self.name!r} runs the attention variant "
                       f"{self.variant.name!r} and takes no other attention variants "
                       f"(attention={', '.join(cfg.variant_names)}); use kv_dtype None "
                       f"with attention={self.variant.name!r}")
    return cfg.replace(attention_variant=self.variant)

  def static_fields(self, cfg: ModelConfig) -> dict:
    """Non-array fields of the cache record (e.g. MLA's value width, the options)."""
    return {**getattr(self.cache, "static_fields", lambda cfg: {})(cfg), **dict(self.options)}


_LAYOUTS: dict = {}


def register(layout: KVLayout) -> KVLayout:
  """Adds `layout` under its name (ValueError if the name is taken by another record)."""
  if _LAYOUTS.get(layout.name, layout) != layout:
    raise ValueError(f"kv layout {layout.name!r} is already registered")
  _LAYOUTS[layout.name] = layout
  return layout


def layout_names() -> tuple:
  return tuple(_LAYOUTS)


def sizing_layout(kv_dtype: Union[None, str, KVLayout], cfg: ModelConfig) -> KVLayout:
  """The layout the ledger sizes (kvjax/parallel/ledger.py): a float dtype name means cfg's default
  layout storing that float (MLA latents at bf16 are what the seeds size), anything else
  the registered layout; None: the default at its store.  Checks only the name."""
  name = short_dtype_name(kv_dtype)
  if isinstance(name, str) and name in FLOAT_STORES:
    return dataclasses.replace(_default(cfg), store=name)
  return get_layout(kv_dtype, cfg, check_model=False)


def _default(cfg: ModelConfig) -> KVLayout:
  return next(l for l in _LAYOUTS.values() if l.default and l.attention == cfg.attention_type)


def with_layout_variant(model, kv_dtype: Union[None, str, "KVLayout"]):
  """`model` (a kvjax.Model) as kv_dtype's layout serves it (KVLayout.serving_config):
  an alias's attention variant on every layer; any other kv_dtype leaves it as it is
  (get_layout checks the name)."""
  layout = kv_dtype
  if isinstance(kv_dtype, str):
    layout = _LAYOUTS.get(short_dtype_name(kv_dtype))
  if not isinstance(layout, KVLayout) or layout.variant is None:
    return model
  return dataclasses.replace(model, config=layout.serving_config(model.config))


def get_layout(kv_dtype: Union[None, str, KVLayout], cfg: ModelConfig, *,
               check_model: bool = True) -> KVLayout:
  """The layout kv_dtype names for cfg (None: cfg's default), checked against cfg's
  attention (and, check_model, against what else cfg needs); ValueError naming the bad
  kv_dtype."""
  if isinstance(kv_dtype, KVLayout):
    layout = kv_dtype
  elif kv_dtype is None:
    layout = _default(cfg)
  else:
    layout = _LAYOUTS.get(short_dtype_name(kv_dtype))
    if layout is None:
      raise ValueError(f"unsupported kv_dtype {kv_dtype!r}; use None or one of "
                       f"{layout_names()}")
  if layout.attention != cfg.attention_type:
    raise ValueError(f"kv_dtype {layout.name!r} is not supported for "
                     f"{cfg.attention_type.upper()} (that layout stores "
                     f"{layout.attention.upper()} K/V; the default keeps the model dtype); "
                     "use kv_dtype=None")
  if not check_model:
    return layout
  if cfg.is_hybrid and not layout.hybrid:
    raise ValueError(f"kv_dtype {layout.name!r} is not supported for hybrid model "
                     f"{cfg.name!r} (its per-slot arrays and recurrent state are not "
                     "combined); use int8")
  layout.check_model(cfg)
  return layout
