"""`EngineConfig`: every option of a serving engine, frozen, validated in one place.

Built once at the boundary (Engine, `kvjax.generate`'s engine path, the CLI
and the benchmarks) and read everywhere else; `resolve(model)` checks it
against the model and fills the model-dependent defaults, so a bad option is a
ValueError naming it before anything is allocated.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional, Union

from kvjax.attention.backends import Backend, get_backend, invariant, on_mesh
from kvjax.attention.variants import BUILT_IN_NAMES, parse_variant_name
from kvjax.caches import KVLayout, check_cache_support, check_hybrid_engine, get_layout
from kvjax.caches.groups import check_grouped_layout, layer_groups
from kvjax.caches.layout import PageRelease, with_layout_variant
from kvjax.engine.sched.mask_release import mask_release
from kvjax.engine.sched.ngram import DEFAULT_NGRAM_N, check_ngram
from kvjax.engine.validation import check_int
from kvjax.lora.peft import MAX_RANK
from kvjax.model.config import ModelConfig, short_dtype_name
from kvjax.parallel.sharding import mesh_of
from kvjax.runtime import speculative as spec

_MAX_INT32 = 2**31 - 1  # positions and page ids are int32 on the device and in the tables

__all__ = ["EngineConfig", "add_engine_flags", "engine_config_from_flags"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Options of kvjax.Engine.

  Attributes:
    page_size: tokens per KV page.
    num_pages: KV pages in the pool, null page included (None: every slot can
      hold the most pages a max_model_len request holds at once, fewer than it
      spans when every layer has a sliding window).
    max_num_seqs: running requests (rows) at most.
    max_num_batched_tokens: token budget per step (draft slots included).
    max_model_len: prompt + max_new_tokens cap (None: the model context).
    prefix_cache: share computed full blocks across requests (C8).
    prefix_match: "block" (vLLM) or "token" (also a partial last block; a
      hybrid model resumes at the hit's last page boundary instead, since its
      recurrent state is kept only there).
    prefix_snapshots: a hybrid model's bound on recurrent-state snapshots kept
      for the prefix cache (one per cached page boundary, LRU;
      kvjax/engine/sched/state_snapshots.py); None: 8 per running request, 0 with the
      prefix cache off.  Dense models keep none.
    min_cacheable_tokens: shorter prefix hits are ignored.
    speculative: None, "mtp" (draft with the model's MTP modules), "ngram"
      (prompt lookup: the tokens that followed the latest occurrence of the
      longest recent n-gram of the request's own tokens, kvjax/engine/sched/ngram.py) or a
      kvjax.Model of the same vocabulary (a draft model with its own paged KV).
    num_draft: draft tokens per verify step (J; None: 2, or 4 with "ngram"), or
      "auto": the drafter's most (the MTP modules, or 4 for a draft model and
      for "ngram") with draft_policy "adaptive".
    ngram_n: with speculative "ngram", the longest n-gram looked up (n from
      ngram_n down to 1; None: 3).
    draft_policy: None (always num_draft drafts), "adaptive" (choose 0..num_draft
      per step from measured step costs and acceptance, kvjax/engine/sched/draft_policy.py),
      or a policy object with that module's interface.
    backend: attention and verification backend, a name or a Backend record
      (kvjax/attention/backends.py).
    num_scheduler_steps: most decode steps one device call runs (multi-step
      scheduling): when every running request decodes and nothing could be
      admitted meanwhile, emitted tokens feed the next step on device, so host
      scheduling and dispatch are paid once per burst.  Outputs do not change;
      a burst's tokens stream out together.  1: one step per call.
    kv_dtype: the KV layout, by name or as a KVLayout record (kvjax/caches/layout.py):
      None (the model dtype), "fp32", "bf16", "fp16", "int8", "int4" or any
      registered layout; "streaming" is an alias, float pages under the attention
      variant sinks4-window1020 (StreamingLLM's sinks + window).  A layout
      declares what it refuses: int4 (KIVI) keeps each slot's incomplete page in
      a per-slot full-precision residual, not in the pool, so it refuses what
      would resume a slot mid-page on stale residual data: token-mode prefix hits
      and speculative decoding.  Its outputs also depend on chunking (a query
      reads its own incomplete page in full precision), so they match the static
      batch only for unchunked prompts; int8 matches it always.
    attention: an attention variant (kvjax.AttentionVariant, a registered name, or a
      function (cfg, layer) -> variant or None; kvjax/attention/variants.py) every
      step applies on top of the model's attention: prefill chunks, decode, bursts,
      verification, prefix hits.  None: the model's own.  A monotone one (in every
      cache layer) releases the pages its mask hides (kvjax/engine/sched/mask_release.py).
    batch_invariant: a request's tokens and logprobs are bitwise the same whatever
      shares its steps, however its prompt is chunked and whether or not it hits the
      prefix cache: matmuls in fixed row tiles, attention in fixed key blocks and
      query tiles (kvjax/model/invariance.py).  Reference backend, dense GQA models, no
      speculation; cost: docs/GUIDE.md "Batch-invariant decoding".
    max_loras: LoRA adapters the device holds at once (Engine.load_adapter; a request
      picks one with add_request(lora=NAME), kvjax/lora/); 0: no adapters.
    max_lora_rank: the largest adapter rank those slots take (at most 64).
    kv_groups: one KV page pool and block table per group of layers with the same window
      (kvjax/caches/groups.py), so a request's sliding layers hold only the pages inside
      their window; num_pages then caps each group's pool (None: each sized for its
      layers).  A model whose layers all attend alike has one group: nothing changes.
      The prefix cache works per group (a hit resumes where every group still caches
      the blocks its layers read; kvjax/engine/sched/group_pages.py), by whole blocks only.
      Speculation ("ngram", "mtp": the MTP modules' layers join their window's group)
      verifies through every group's pages, on any backend (a layer's group pool and
      table go to its attention).  Not yet with a draft model, prefix_match="token", a
      mesh, or layouts other than float and int8 pages (each refused by name).
  """

  page_size: int = 16
  num_pages: Optional[int] = None
  max_num_seqs: int = 8
  max_num_batched_tokens: int = 512
  max_model_len: Optional[int] = None
  prefix_cache: bool = True
  prefix_match: str = "block"
  prefix_snapshots: Optional[int] = None
  min_cacheable_tokens: int = 0
  speculative: Any = None
  num_draft: Union[int, str, None] = None
  ngram_n: Optional[int] = None
  draft_policy: Any = None
  backend: Union[str, Backend] = "reference"
  num_scheduler_steps: int = 16
  kv_dtype: Union[str, KVLayout, None] = None
  attention: Any = None
  batch_invariant: bool = False
  max_loras: int = 0
  max_lora_rank: int = 16
  kv_groups: bool = False

  @property
  def draft_model(self):
    """The separate draft model, or None (no speculation, or MTP drafting)."""
    return None if isinstance(self.speculative, (str, type(None))) else self.speculative

  @property
  def drafts_per_step(self) -> int:
    """J of the step programs: num_draft with speculation, 0 without."""
    return self.num_draft if self.speculative is not None else 0

  def resolve(self, model) -> "EngineConfig":
    """Validated against `model`, defaults filled; ValueError naming a bad option."""
    cfg: ModelConfig = model.config
    backend = on_mesh(get_backend(self.backend), mesh_of(model.params))  # its kernels per device
    layout = check_cache_support(self.kv_dtype, cfg, "paged", backend)
    check_hybrid_engine(speculative=self.speculative)
    if not isinstance(self.prefix_cache, bool):
      raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
    if not isinstance(self.batch_invariant, bool):
      raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
    if self.batch_invariant:
      backend = self._invariant_backend(backend, cfg)
    self._check_groups(cfg, backend)
    config = dataclasses.replace(self, prefix_snapshots=self._snapshots(cfg))
    config._check_layout(layout)
    config = config._resolve_drafts(model)
    draft = config.draft_model
    if draft is not None:
      if not (hasattr(draft, "config") and hasattr(draft, "params")):
        raise ValueError(f"speculative must be None, 'mtp', 'ngram' or a kvjax.Model, got "
                         f"{type(draft).__name__}")
      spec.check_draft_model(cfg, draft.config, config.num_draft)
      # Its cache reads the same pages, so an alias kv_dtype's variant runs there too.
      config = dataclasses.replace(config,
                                   speculative=with_layout_variant(draft, self.kv_dtype))
    elif self.speculative not in (None, "mtp", "ngram"):
      raise ValueError(f"speculative must be None, 'mtp', 'ngram' or a kvjax.Model, got "
                       f"{self.speculative!r}")
    elif self.speculative == "ngram":
      check_ngram(config.ngram_n, config.num_draft)
    elif self.speculative:
      spec.check_mtp(cfg, model.params, config.num_draft)
    if self.prefix_match not in ("block", "token"):
      raise ValueError(f"prefix_match must be 'block' or 'token', got {self.prefix_match!r}")
    check_int("max_loras", self.max_loras, 0)
    check_int("max_lora_rank", self.max_lora_rank, 1, MAX_RANK + 1)
    if self.max_loras and mesh_of(model.params) is not None:
      raise ValueError("max_loras needs a single-device model (adapter slots are not sharded)")
    if self.max_loras and self.batch_invariant:  # the adapter deltas are not row-tiled
      raise ValueError("max_loras needs batch_invariant=False")
    for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    max_model_len = cfg.max_position_embeddings if self.max_model_len is None else \
        check_int("max_model_len", self.max_model_len, 1)
    if not 1 <= max_model_len <= cfg.max_position_embeddings:
      raise ValueError(f"max_model_len must be in [1, {cfg.max_position_embeddings}] "
                       f"(the model context), got {max_model_len}")
    num_pages = self.num_pages
    if num_pages is not None:
      check_int("num_pages", num_pages, 2)  # the null page and one to hold a request
    else:  # a windowed model's requests hold a bounded number of pages
      releases = [release for _, release in config._group_releases(cfg)] or [
          self.page_release(cfg)]
      num_pages = max(1 + self.max_num_seqs * release.max_pages_held(
          max_model_len, self.max_num_batched_tokens) for release in releases)
    if num_pages >= _MAX_INT32 or max_model_len >= _MAX_INT32:
      source = "" if self.max_model_len else " (the model's max_position_embeddings)"
      raise ValueError(f"max_model_len={max_model_len}{source} with num_pages={num_pages} "
                       f"is past the int32 positions and page ids the steps use; pass a "
                       f"smaller max_model_len (and num_pages)")
    return dataclasses.replace(config, backend=backend, max_model_len=max_model_len,
                               num_pages=num_pages, kv_dtype=short_dtype_name(self.kv_dtype))

  def _invariant_backend(self, backend: Backend, cfg: ModelConfig) -> Backend:
    """backend's batch-invariant record; ValueError naming what it cannot cover."""
    if self.speculative is not None:  # verify steps score tokens in wider programs
      raise ValueError(f"batch_invariant needs speculative=None, got {self.speculative!r}")
    if cfg.attention_type != "gqa" or cfg.is_hybrid or cfg.num_experts:
      raise ValueError(f"batch_invariant covers dense GQA models; {cfg.name!r} has "
                       f"attention_type={cfg.attention_type!r}, hybrid={cfg.is_hybrid}, "
                       f"num_experts={cfg.num_experts}")
    return invariant(backend)

  def _resolve_drafts(self, model) -> "EngineConfig":
    """num_draft None -> its default, "auto" -> the drafter's most drafts with the
    adaptive policy; ngram_n None -> its default with "ngram"."""
    if isinstance(self.num_draft, bool) or not (self.num_draft in ("auto", None)
                                                or isinstance(self.num_draft, int)):
      raise ValueError(f"num_draft must be an int or 'auto', got {self.num_draft!r}")
    ngram = self.speculative == "ngram"
    if self.ngram_n is not None and not ngram:
      raise ValueError(f"ngram_n={self.ngram_n!r} needs speculative='ngram', got "
                       f"speculative={self.speculative!r}")
    config = dataclasses.replace(self, ngram_n=DEFAULT_NGRAM_N if ngram and self.ngram_n is None
                                 else self.ngram_n)
    if self.num_draft is None:
      config = dataclasses.replace(config, num_draft=_NGRAM_DRAFTS if ngram else 2)
    if self.speculative is None:
      if self.draft_policy is not None:
        raise ValueError(f"draft_policy={self.draft_policy!r} needs speculative decoding "
                         "(speculative='mtp', 'ngram' or a draft model)")
      return config
    if config.num_draft != "auto":
      return config
    if self.speculative == "mtp":
      most = min(model.config.mtp_num_hidden_layers, len(model.params.mtp))
    else:
      most = _NGRAM_DRAFTS if ngram else _AUTO_DRAFT_MODEL_DRAFTS
    return dataclasses.replace(config, num_draft=most,
                               draft_policy=self.draft_policy or "adaptive")

  def layer_groups(self, cfg: ModelConfig) -> tuple:
    """cfg's KV layer groups when the engine keeps a pool per group (kv_groups and more
    than one group; kvjax/caches/groups.py), else ()."""
    # MTP modules draft through cache layers of their own, each in its window's group.
    groups = layer_groups(cfg, self.speculative == "mtp") if self.kv_groups else ()
    return groups if len(groups) > 1 else ()

  def _group_releases(self, cfg: ModelConfig) -> list:
    """(group, its page release) of each layer group (none: one pool)."""
    layout = get_layout(self.kv_dtype, cfg)
    return [(group, mask_release(layout.page_release(self.page_size, group.window), cfg,
                                 draft=None, layers=group.layers))
            for group in self.layer_groups(cfg)]

  def group_pools(self, cfg: ModelConfig) -> list:
    """(pages, page release) of each layer group's pool, group 0's first (none: one pool):
    each holds max_num_seqs requests of max_model_len at once, at most num_pages."""
    return [(min(self.num_pages, 1 + self.max_num_seqs * release.max_pages_held(
        self.max_model_len, self.max_num_batched_tokens)), release)
            for _, release in self._group_releases(cfg)]

  def _check_groups(self, cfg: ModelConfig, backend: Backend) -> None:
    """ValueError naming what kv_groups does not cover yet."""
    if not isinstance(self.kv_groups, bool):
      raise ValueError(f"kv_groups must be True or False, got {self.kv_groups!r}")
    if not self.layer_groups(cfg):
      return
    check_grouped_layout(self.kv_dtype, cfg)
    if backend.mesh is not None:  # the group pools are not sharded
      raise ValueError("kv_groups does not support a model on a mesh (tensor, expert or "
                       "data parallelism) yet")
    if self.draft_model is not None:  # its one pool follows group 0's table only
      raise ValueError("kv_groups does not support a draft model (speculative=kvjax.Model) "
                       "yet: its KV pages would need a pool and block table per group of "
                       "its own layers; use speculative='ngram' or 'mtp'")
    for name, value, ok in (("prefix_match", self.prefix_match,
                             not self.prefix_cache or self.prefix_match == "block"),
                            ("batch_invariant", self.batch_invariant, not self.batch_invariant)):
      if not ok:
        raise ValueError(f"kv_groups does not support {name}={value!r} yet")

  def page_release(self, cfg: ModelConfig) -> PageRelease:
    """The layout's host-side page manager: which pages a request may release (also those
    a monotone attention variant hides; kvjax/engine/sched/mask_release.py)."""
    layout = get_layout(self.kv_dtype, cfg)
    base = layout.page_release(self.page_size, self.widest_window(cfg))
    draft = self.draft_model
    return mask_release(base, cfg, draft=None if draft is None else draft.config)

  def prefill_full_width(self, cfg: ModelConfig) -> bool:
    """Whether prefill chunks may take the widest block table (kvjax/engine/sched/batching.py): the
    layout attends through the backend and the backend reads only as far as kv_lens."""
    return get_layout(self.kv_dtype, cfg).prefill_full_width and \
        self.backend.prefill_full_width

  def widest_window(self, cfg: ModelConfig) -> Optional[int]:
    """Widest window over every layer reading the pages; None if one sees everything."""
    draft = self.draft_model
    windows = [cfg.kv_window] + ([draft.config.kv_window] if draft is not None else [])
    return None if None in windows else max(windows)

  def _snapshots(self, cfg: ModelConfig) -> int:
    """prefix_snapshots resolved: the bound given, or the default (see the field)."""
    given = self.prefix_snapshots
    if given is not None and (isinstance(given, bool) or not isinstance(given, int)
                              or given < 0):
      raise ValueError(f"prefix_snapshots must be an int >= 0 or None, got {given!r}")
    if not (cfg.is_hybrid and self.prefix_cache):
      if given:
        raise ValueError(f"prefix_snapshots={given} needs a hybrid model with the prefix "
                         f"cache on ({cfg.name!r} is {'hybrid' if cfg.is_hybrid else 'dense'})")
      return 0
    return 8 * self.max_num_seqs if given is None else given

  def _check_layout(self, layout: KVLayout) -> None:
    """ValueError for what the KV layout declares it cannot serve; see kv_dtype."""
    if self.speculative is not None and layout.no_speculation:
      drafter = self.speculative if isinstance(self.speculative, str) else "a draft model"
      raise ValueError(f"kv_dtype {layout.name!r} cannot verify drafts (speculative="
                       f"{drafter!r}): {layout.no_speculation}")
    if self.prefix_cache and self.prefix_match == "token" and layout.no_token_prefix:
      raise ValueError(f"kv_dtype {layout.name!r} cannot reuse partial pages "
                       f"(prefix_match='token'): {layout.no_token_prefix}")


_AUTO_DRAFT_MODEL_DRAFTS = 4  # num_draft "auto" with a separate draft model
_NGRAM_DRAFTS = 4  # num_draft None or "auto" with speculative "ngram"


def _int_or_auto(text: str):
  """--num-draft: an int or 'auto'."""
  return text if text == "auto" else int(text)

# Command-line form of each field (kvjax bench, kvjax serve): flag -> (type, choices, help).
_FLAGS = {
    "page_size": (int, None, "tokens per KV page"),
    "num_pages": (int, None, "KV pages in the pool (default: sized from max_model_len)"),
    "max_num_seqs": (int, None, "running requests at most"),
    "max_num_batched_tokens": (int, None, "token budget per step"),
    "max_model_len": (int, None, "prompt + new tokens cap (default: the model context)"),
    "prefix_cache": (bool, None, "share computed blocks across requests"),
    "prefix_match": (str, ("block", "token"), "prefix hits: whole blocks or tokens"),
    "prefix_snapshots": (int, None, "hybrid models: recurrent-state snapshots kept for the "
                                    "prefix cache (default: 8 per running request)"),
    "min_cacheable_tokens": (int, None, "shorter prefix hits are ignored"),
    "speculative": (str, ("mtp", "ngram"), "draft with the model's MTP modules, or by "
                                           "prompt lookup (n-gram) (default: off)"),
    "num_draft": (_int_or_auto, None, "draft tokens per verify step, or auto (adaptive) "
                                      "(default: 2, 4 with ngram)"),
    "ngram_n": (int, None, "speculative ngram: longest n-gram looked up (default: 3)"),
    "draft_policy": (str, ("adaptive",), "choose 0..num_draft drafts per step from measured "
                                         "costs and acceptance (default: off, a "
                                         "fixed num_draft)"),
    "backend": (str, None, "attention + verification backend"),
    "num_scheduler_steps": (int, None, "most decode steps per device call"),
    "kv_dtype": (str, None, "KV layout: fp32 | bf16 | fp16 (or float32 ...), int8, int4, "
                            "or another registered layout (kvjax/caches/layout.py; "
                            "default: the weights' dtype)"),
    "attention": (parse_variant_name, None,
                  "attention variant: a registered name or " + ", ".join(BUILT_IN_NAMES) +
                  " (kvjax/attention/variants.py; default: none, full attention)"),
    "batch_invariant": (bool, None, "bitwise the same tokens and logprobs for a request "
                                    "whatever shares its steps (reference backend)"),
    "max_loras": (int, None, "LoRA adapters held on the device at once (serve --lora)"),
    "max_lora_rank": (int, None, "largest LoRA adapter rank (at most 64)"),
    "kv_groups": (bool, None, "one KV page pool per group of layers with the same window"),
}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
  """One --flag per EngineConfig field, defaults from EngineConfig (shown in --help)."""
  defaults = EngineConfig()
  for name, (kind, choices, text) in _FLAGS.items():
    flag, default = "--" + name.replace("_", "-"), getattr(defaults, name)
    text = text if "default:" in text else f"{text} (default: %(default)s)"
    if kind is bool:
      parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                          help=text)
    else:
      parser.add_argument(flag, type=kind, choices=choices, default=default, help=text)


def engine_config_from_flags(args: argparse.Namespace, **overrides) -> EngineConfig:
  """The EngineConfig the flags of add_engine_flags describe (overrides win)."""
  return EngineConfig(**{**{name: getattr(args, name) for name in _FLAGS}, **overrides})
