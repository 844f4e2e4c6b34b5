"""Host-side arithmetic behind the mechanism claims: counted, never closed-form.

Pure Python/numpy over `ModelConfig`, the ledger and the host allocator, so the
tests check it in milliseconds and experiments/mechanism_bench.py prints it
beside its timings:

* C2: attention work to generate n tokens, counted step by step as score-matrix
  entries and as K/V pairs, with and without a cache.
* C3: FLOPs and bytes of one forward step from a config (decode vs prefill).
* C7: one workload through kvjax's Scheduler twice, with 16-token pages and
  with one max_model_len "page" per request (a contiguous reservation), and a
  first-fit contiguous pool beside a BlockAllocator on the seed's
  fragmentation example.
* C11: how many KV tokens a fixed pool holds with the MTP modules' layers
  cached or not, and what else speculation reserves.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kvjax.engine.sched.pages import BlockAllocator
from kvjax.engine.sched.scheduler import Scheduler
from kvjax.model.config import ModelConfig
from kvjax.model.presets import get_preset
from kvjax.parallel import ledger

__all__ = ["score_entries", "kv_pairs", "matmul_params", "step_cost", "lognormal_workload",
           "simulate_pool", "FirstFitPool", "fragmentation_trace", "deepseek_v3_like",
           "mtp_pool_tokens", "mtp_reserved_bytes"]


# -- C2: attention work ----------------------------------------------------------


def score_entries(n: int) -> dict:
  """Score-matrix entries computed to generate n tokens, counted step by step.

  Step t (1-based) has t tokens of history.  Without a cache it recomputes the
  whole t x t score matrix (`no_cache`; `no_cache_causal` counts only the
  entries a causal mask keeps); with a cache its one new query meets t keys.
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  full = causal = cached = 0
  for t in range(1, n + 1):
    q = np.arange(t)[:, None]  # query positions
    k = np.arange(t)[None, :]  # key positions
    full += np.count_nonzero(np.ones((t, t), bool))
    causal += np.count_nonzero(k <= q)
    cached += np.count_nonzero(k[0] <= t - 1)  # the newest query's row
  return dict(no_cache=full, no_cache_causal=causal, cache=cached)


def kv_pairs(n: int) -> dict:
  """K/V pairs projected to generate n tokens: every prefix token per step vs one."""
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  no_cache = cache = 0
  for t in range(1, n + 1):
    no_cache += len(range(t))  # recompute K, V of all t tokens
    cache += 1  # only the new token's
  return dict(no_cache=no_cache, cache=cache)


# -- C3: FLOPs and bytes of one step ---------------------------------------------


def matmul_params(cfg: ModelConfig) -> int:
  """Weights each token multiplies through: projections, MLP, LM head (no MTP, no embedding)."""
  if cfg.attention_type != "gqa" or cfg.num_experts:
    raise ValueError(f"matmul_params counts dense GQA models; {cfg.name!r} is "
                     f"{cfg.attention_type} with {cfg.num_experts} experts")
  d, n, k, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f  # q, k, v, o; gate, up, down
  return cfg.num_layers * per_layer + d * cfg.vocab_size


def step_cost(cfg: ModelConfig, context: int, new_tokens: int, bytes_per_value: int,
              batch: int = 1) -> dict:
  """One forward of `new_tokens` per row after `context` cached tokens (causal).

  Query i (0-based) of a row sees context + i + 1 keys; each (query, key) costs
  2 * H FLOPs per q head for the score and 2 * H for the value sum.  Bytes: the
  weights once per step, and per row the K/V of every token it attends to
  (the cached ones read, the new ones written).
  """
  if context < 0 or new_tokens < 1 or batch < 1:
    raise ValueError(f"need context >= 0, new_tokens >= 1, batch >= 1; got {context}, "
                     f"{new_tokens}, {batch}")
  layers, n, k, h = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  keys = sum(context + i + 1 for i in range(new_tokens))  # (query, key) pairs per row
  attention_flops = batch * layers * n * keys * 4 * h
  matmul_flops = 2 * matmul_params(cfg) * batch * new_tokens
  weight_bytes = matmul_params(cfg) * bytes_per_value
  kv_bytes = batch * (context + new_tokens) * layers * 2 * k * h * bytes_per_value
  return dict(flops=matmul_flops + attention_flops, attention_flops=attention_flops,
              weight_bytes=weight_bytes, kv_bytes=kv_bytes,
              intensity=(matmul_flops + attention_flops) / (weight_bytes + kv_bytes),
              attention_flops_per_kv_byte=attention_flops / kv_bytes)


# -- C7: contiguous reservations vs pages ----------------------------------------


def lognormal_workload(num_requests: int, prompt_median: float, output_median: float,
                       sigma: float, max_model_len: int, seed: int) -> list:
  """[(prompt_len, output_len)]: lognormal lengths, each request <= max_model_len."""
  rng = np.random.default_rng(seed)
  prompts = np.clip(np.rint(prompt_median * rng.lognormal(0, sigma, num_requests)), 1,
                    max_model_len // 2)
  outputs = np.rint(output_median * rng.lognormal(0, sigma, num_requests))
  outputs = np.clip(outputs, 1, max_model_len - prompts)
  return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def simulate_pool(workload: list, *, pool_tokens: int, page_size: int, max_model_len: int,
                  max_num_batched_tokens: int, check_every: int = 0) -> dict:
  """Run `workload` to completion through a Scheduler over `pool_tokens` of KV.

  `page_size == max_model_len` is the contiguous baseline: every admitted
  request reserves one max_model_len region up front.  Each step every sampled
  row emits one token (EOS off).  Per step, after the update: `held` = KV
  positions the running requests have written, `reserved` = tokens of the pages
  they hold.  `check_every` > 0 checks the scheduler's invariants that often.
  """
  if pool_tokens % page_size:
    raise ValueError(f"pool_tokens {pool_tokens} is not a multiple of page_size {page_size}")
  num_pages = pool_tokens // page_size
  scheduler = Scheduler(num_pages=num_pages + 1, page_size=page_size,
                        max_num_seqs=len(workload), max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, enable_prefix_caching=False)
  for i, (prompt_len, output_len) in enumerate(workload):
    scheduler.add_request(str(i), [0] * prompt_len, output_len)
  held, reserved, running, output_tokens = [], [], [], 0
  while scheduler.has_unfinished:
    out = scheduler.schedule()
    new = {r.request_id: [1] for r in out.rows if r.sample}
    output_tokens += len(new)
    scheduler.update_from_output(out, new)
    held.append(sum(r.num_computed_tokens for r in scheduler.running))
    reserved.append(scheduler.allocator.num_used * page_size)
    running.append(len(scheduler.running))
    if check_every and len(held) % check_every == 0:
      scheduler.check_invariants()
  held, reserved = np.asarray(held), np.asarray(reserved)
  busy = reserved > 0
  return dict(
      page_size=page_size, pool_tokens=pool_tokens, steps=len(held),
      output_tokens=output_tokens, output_tokens_per_step=output_tokens / len(held),
      utilization=float(held[busy].sum() / reserved[busy].sum()),  # of reserved KV
      pool_utilization=float(held.mean() / pool_tokens),
      mean_running=float(np.mean(running)), max_running=int(np.max(running)),
      preemptions=scheduler.num_preemptions)


class FirstFitPool:
  """Contiguous regions of [0, size): the pre-paging allocator that fragments."""

  def __init__(self, size: int):
    self.size = size
    self.regions: dict[str, tuple[int, int]] = {}  # name -> (start, length)

  def holes(self) -> list:
    """Free (start, length) gaps in address order."""
    gaps, cursor = [], 0
    for start, length in sorted(self.regions.values()):
      if start > cursor:
        gaps.append((cursor, start - cursor))
      cursor = start + length
    if cursor < self.size:
      gaps.append((cursor, self.size - cursor))
    return gaps

  def allocate(self, name: str, length: int) -> Optional[int]:
    """Start of the first gap that fits `length`, or None: no contiguous region."""
    if name in self.regions:
      raise ValueError(f"region {name!r} is already allocated")
    for start, gap in self.holes():
      if gap >= length:
        self.regions[name] = (start, length)
        return start
    return None

  def free(self, name: str) -> None:
    del self.regions[name]


def fragmentation_trace(num_requests: int = 16, unit_tokens: int = 8192, page_size: int = 16,
                        big_units: int = 2) -> dict:
  """The seed's example replayed: free memory in holes, no contiguous region.

  `num_requests` requests of one unit (8192 tokens: 1 GiB of llama3-8b fp16 KV)
  fill the pool; every second one finishes; a request of `big_units` units then
  asks for memory, first from a first-fit contiguous pool, then from a
  BlockAllocator of `page_size`-token pages that went through the same trace.
  """
  contiguous = FirstFitPool(num_requests * unit_tokens)
  pages_per_unit = unit_tokens // page_size
  paged = BlockAllocator(num_requests * pages_per_unit + 1)
  held, log = {}, []
  for i in range(num_requests):
    name = f"r{i}"
    contiguous.allocate(name, unit_tokens)
    held[name] = paged.allocate(pages_per_unit)
  log.append(f"{num_requests} requests x {unit_tokens} tokens fill the pool")
  for i in range(1, num_requests, 2):
    contiguous.free(f"r{i}")
    paged.free(held.pop(f"r{i}"))
  holes = contiguous.holes()
  log.append(f"every second request finishes: {sum(g for _, g in holes)} tokens free in "
             f"{len(holes)} holes of at most {max(g for _, g in holes)} tokens")
  need = big_units * unit_tokens
  start = contiguous.allocate("big", need)
  log.append(f"contiguous: a {need}-token request -> "
             + ("no region" if start is None else f"region at {start}"))
  pages = paged.allocate(need // page_size)
  runs = 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:]))
  log.append(f"paged: the same request -> {len(pages)} pages in {runs} physically "
             f"separate runs, block table maps them in order")
  paged.check_invariants()
  return dict(free_tokens=sum(g for _, g in holes), num_holes=len(holes),
              largest_hole=max(g for _, g in holes), request_tokens=need,
              contiguous_fits=start is not None, paged_pages=len(pages), paged_runs=runs,
              log=log)


# -- C11: what MTP costs a fixed pool --------------------------------------------


def deepseek_v3_like() -> ModelConfig:
  """DeepSeek-V3's KV shapes (61 MLA layers, latent 512 + rope 64, one MTP module)."""
  return get_preset("deepseek-v2").replace(
      name="deepseek-v3-like", num_layers=61, hidden_size=7168, vocab_size=129280,
      mtp_num_hidden_layers=1)


def mtp_pool_tokens(cfg: ModelConfig, pool_bytes: int, kv_dtype: str = "bf16") -> dict:
  """Tokens `pool_bytes` of KV holds when MTP layers are cached (on) or not (off)."""
  if cfg.mtp_num_hidden_layers == 0:
    raise ValueError(f"{cfg.name!r} has no MTP modules (mtp_num_hidden_layers=0)")
  off = pool_bytes // ledger.kv_bytes_per_token(cfg, kv_dtype, include_mtp=False)
  on = pool_bytes // ledger.kv_bytes_per_token(cfg, kv_dtype, include_mtp=True)
  return dict(off=off, on=on, change=on / off - 1)


def mtp_reserved_bytes(cfg: ModelConfig, max_num_seqs: int, num_draft: int,
                       weight_dtype: str = "bf16") -> dict:
  """Non-KV memory MTP speculation takes from the pool, as kvjax's Engine lays it out.

  MTP module weights; the draft probabilities the Engine keeps per slot
  ([slots, K, V] f32, EngineState.draft_probs) and the verify step's logits
  ([slots, K + 1, V] f32).
  """
  base = cfg.replace(mtp_num_hidden_layers=0)
  weights = ledger.weight_bytes(cfg, weight_dtype) - ledger.weight_bytes(base, weight_dtype)
  slots = max_num_seqs + 1  # the Engine's spare padding slot
  return dict(mtp_weights=weights, draft_probs=slots * num_draft * cfg.vocab_size * 4,
              verify_logits=slots * (num_draft + 1) * cfg.vocab_size * 4)
