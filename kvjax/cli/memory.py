"""`python -m kvjax memory`: size a card for a preset or checkpoint from the shell (C4-C5).

A thin argparse face over `kvjax.parallel.ledger.plan`; the ledger owns every check, so a
bad preset, context or dtype gets the same message here as in Python, and exit
code 2 like any other usage error.  Beside the arithmetic, `allocated_pool`
measures the cache the engine would allocate for the preset (jax.eval_shape of
create_paged_cache: abstract arrays, nothing allocated): bytes per token of its
page arrays and bytes per slot of its per-slot state (a hybrid's recurrent
state, int4's residual), so C4's per-token figure comes from the real pool.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax

from kvjax.api import resolve_dtype
from kvjax.caches import create_paged_cache, layout_names
from kvjax.caches.groups import layer_groups
from kvjax.model.config import ModelConfig
from kvjax.model.presets import PRESETS, get_preset
from kvjax.parallel import ledger
from kvjax.parallel import ledger_tp
from kvjax.weights import gguf
from kvjax.weights.checkpoint import read_config

__all__ = ["add_parser", "run", "allocated_pool"]

_DTYPES = "|".join(ledger.DTYPE_BITS)
_LAYOUTS = "|".join(name for name in layout_names() if name not in ("float", "latent"))


def add_parser(subparsers) -> argparse.ArgumentParser:
  """Registers the `memory` sub-command on an argparse `subparsers` object."""
  p = subparsers.add_parser(
      "memory", help="KV-cache, weight and concurrency ledger for a preset",
      description="KV bytes per token and per request, weight bytes, max concurrency "
                  "and total memory for --batch concurrent requests. Sizes in GiB "
                  "(binary); the seeds' 'GB' are read as GiB.")
  model = p.add_mutually_exclusive_group(required=True)
  model.add_argument("--preset", help=f"one of: {', '.join(PRESETS)}")
  model.add_argument("--checkpoint", help="a kvjax checkpoint directory, a GGUF file or a "
                                          "packaged GGUF's name (its config only is read)")
  p.add_argument("--context", type=int, required=True, help="tokens per request")
  p.add_argument("--batch", type=int, default=1,
                 help="target concurrency for the total-memory line (default 1)")
  p.add_argument("--kv-dtype", default="bf16",
                 help=f"KV layout: {_LAYOUTS} (default bf16; kvjax/caches/layout.py)")
  p.add_argument("--weight-dtype", default="bf16", help=f"{_DTYPES} (default bf16)")
  p.add_argument("--weight-gib", type=float, default=None,
                 help="weight size in GiB, overriding the size computed from the config")
  p.add_argument("--gpu-gib", type=float, default=80.0, help="card memory (default 80)")
  p.add_argument("--reserve-gib", type=float, default=4.0,
                 help="framework reserve (default 4)")
  p.add_argument("--include-mtp", action="store_true",
                 help="count the KV pages of the MTP draft blocks too")
  p.add_argument("--count-scales", action="store_true",
                 help="add int8/int4 KV scales to per-request bytes and concurrency")
  p.add_argument("--tp", type=int, default=None,
                 help="tensor-parallel degree: also print per-device weight and KV bytes, "
                      "the kv-head replication cost and the smallest tp that fits "
                      "(default: no per-device lines; 1 when only --ep is given)")
  p.add_argument("--ep", type=int, default=None,
                 help="expert-parallel degree of a mixture-of-experts preset: per-device "
                      "lines with its routed experts split ep ways (x --tp), their bytes per "
                      "device and the smallest ep that fits (default: experts not split)")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.set_defaults(func=run)
  return p


def allocated_pool(cfg: ModelConfig, kv_dtype: str, weight_dtype: str,
                   include_mtp: bool = False) -> dict:
  """Bytes per token of the pages, per slot of the slot state and per prefix-cache state
  snapshot (hybrids) that the engine's cache for cfg holds (abstract shapes: 64 pages
  of 16 tokens, 2 slots, 2 snapshots)."""
  num_pages, page_size, num_slots = 64, 16, 2
  num_snapshots = num_slots if cfg.is_hybrid else 0
  dtype = resolve_dtype(weight_dtype if weight_dtype in ("fp32", "bf16", "fp16") else "bf16")
  cache = jax.eval_shape(lambda: create_paged_cache(
      cfg, kv_dtype, num_slots, num_pages, page_size, dtype, with_mtp=include_mtp,
      num_snapshots=num_snapshots))

  def total(names):
    arrays = [getattr(cache, name) for name in names]
    return sum(a.size * a.dtype.itemsize for a in arrays if a is not None)

  return {"kv_bytes_per_token": total(cache.PAGE_ARRAYS) / (num_pages * page_size),
          "state_bytes_per_slot": total(cache.SLOT_ARRAYS) / num_slots,
          "snapshot_bytes": total(cache.SNAPSHOT_ARRAYS) / max(num_snapshots, 1),
          "cache": type(cache).__name__}


def model_config(args: argparse.Namespace) -> ModelConfig:
  """The config --preset names, or --checkpoint's read without its tensors."""
  if args.preset is not None:
    return get_preset(args.preset)
  gguf_file = gguf.gguf_path(args.checkpoint)
  if gguf_file is not None:
    return gguf.read_gguf_config(gguf_file)
  try:
    return read_config(args.checkpoint)
  except FileNotFoundError as e:
    raise ValueError(f"--checkpoint {args.checkpoint!r}: {e}") from None


def _gib(n: int) -> str:
  return f"{n / ledger.GIB:.3f} GiB"


def run(args: argparse.Namespace) -> int:
  """Prints the plan for `args`; returns 0, or 2 with a message on bad input."""
  try:
    cfg = model_config(args)
    result = ledger.plan(
        cfg, args.context, batch=args.batch, kv_dtype=args.kv_dtype,
        weight_dtype=args.weight_dtype, weight_gib=args.weight_gib, gpu_gib=args.gpu_gib,
        reserve_gib=args.reserve_gib, include_mtp=args.include_mtp,
        count_scales=args.count_scales)
    per_device = None if args.tp is None and args.ep is None else ledger_tp.tp_plan(
        cfg, args.context, args.tp or 1, batch=args.batch,
        kv_dtype=args.kv_dtype, weight_dtype=args.weight_dtype, gpu_gib=args.gpu_gib,
        reserve_gib=args.reserve_gib, include_mtp=args.include_mtp,
        count_scales=args.count_scales, ep=args.ep or 1)
    pool = allocated_pool(cfg, args.kv_dtype, args.weight_dtype, args.include_mtp)
    groups = layer_groups(cfg)
    grouped = {} if len(groups) == 1 else {
        "kv_group_bytes_per_request": ledger.kv_group_bytes_per_request(
            cfg, args.context, args.kv_dtype),
        "layer_groups": [{"window": g.window, "layers": len(g.layers)} for g in groups]}
  except ValueError as e:
    print(f"kvjax memory: error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(dataclasses.asdict(result) | {"allocated_pool": pool} | grouped | (
        {} if per_device is None else {"tp": dataclasses.asdict(per_device)}), indent=2))
    return 0
  r = result
  scales = (f" (+{r.kv_scale_bytes_per_token / ledger.KIB:g} KiB scales"
            f"{', counted' if r.scales_counted else ', not counted'})"
            if r.kv_scale_bytes_per_token else "")
  print(f"{r.preset}: context {r.context}, kv {r.kv_dtype}, weights {r.weight_dtype}")
  print(f"  KV per token     {r.kv_bytes_per_token / ledger.KIB:g} KiB{scales}")
  print(f"  KV per request   {_gib(r.kv_bytes_per_request)}")
  if grouped:
    windows = ", ".join(f"{g['layers']} layers of window {g['window'] or 'all'}"
                        for g in grouped["layer_groups"])
    print(f"  pools per group  {_gib(grouped['kv_group_bytes_per_request'])} per request in "
          f"pages of {ledger.PAGE_SIZE} ({windows}; --kv-groups)")
  if r.state_bytes_per_request:
    print(f"  state / request  {r.state_bytes_per_request / 2**20:.2f} MiB (per-slot: "
          "recurrent state, int4 residual; any context)")
  if pool["snapshot_bytes"]:
    print(f"  state snapshot   {pool['snapshot_bytes'] / 2**20:.2f} MiB per cached page "
          "boundary (prefix cache; --prefix-snapshots bounds them)")
  print(f"  allocated pool   {pool['kv_bytes_per_token']:,.0f} B/token of pages, "
        f"{pool['state_bytes_per_slot']:,.0f} B/slot of state ({pool['cache']})")
  print(f"  weights          {_gib(r.weight_bytes)} ({r.param_count / 1e9:.2f}B params)")
  moe = cfg
  if moe.num_experts:
    print(f"  active per token {ledger.param_count(moe, active=True) / 1e9:.2f}B params "
          f"({moe.num_experts_per_tok} of {moe.num_experts} routed experts)")
  print(f"  free for KV      {_gib(r.free_kv_bytes)} = {_gib(r.gpu_bytes)} card"
        f" - weights - {_gib(r.reserve_bytes)} reserve")
  print(f"  max concurrency  {r.max_concurrency}")
  print(f"  total at batch {r.batch}: {_gib(r.total_bytes)}"
        f" ({'fits' if r.fits else 'does NOT fit'} in {_gib(r.gpu_bytes)})")
  if per_device is not None:
    _print_tp(per_device, r.gpu_bytes, cfg.attention_type == "mla")
  return 0


def _print_tp(t: ledger_tp.TPPlan, gpu_bytes: int, mla: bool) -> None:
  print(f"  per device at tp={t.tp}" + (f", ep={t.ep}:" if t.ep > 1 else ":"))
  print(f"    weights        {_gib(t.weight_bytes_per_device)}")
  if t.expert_bytes_per_device:
    print(f"    experts        {_gib(t.expert_bytes_per_device)} of those (routed, 1/{t.ep} "
          f"of them a device{f', 1/{t.tp} of each' if t.tp > 1 else ''})")
  print(f"    KV per token   {t.kv_bytes_per_token_per_device / ledger.KIB:g} KiB "
        f"({'the latent, replicated' if mla else f'{t.stored_kv_heads // t.tp} kv heads'}"
        " a device)")
  if t.kv_replication > 1:
    print(f"    replication    each kv head stored {t.kv_replication}x ({t.stored_kv_heads} "
          f"heads): +{t.kv_replication_bytes_per_token / ledger.KIB:g} KiB per token "
          f"over the mesh")
  print(f"    KV per request {_gib(t.kv_bytes_per_request_per_device)}")
  print(f"    max concurrency {t.max_concurrency}; batch {t.batch} "
        f"{'fits' if t.fits else 'does NOT fit'} in {_gib(gpu_bytes)}")
  at_ep = f" at ep={t.ep}" if t.ep > 1 else ""
  print(f"  smallest tp that fits{at_ep}: {t.smallest_tp or 'none up to 64'}")
  if t.expert_bytes_per_device:
    print(f"  smallest ep that fits at tp={t.tp}: {t.smallest_ep or 'none'}")
