"""Mechanism claims C1, C2, C3, C7, C11, C13, C17: seed value beside ours.

C1   K/V in the paged cache after prefill + decode vs a fresh full forward's
     K/V (captured per layer), decode logits vs full-forward logits, greedy
     tokens with and without the cache.
C2   attention work counted step by step (experiments/mechanism_counts.py) and
     kvjax.generate timed with cache="none" vs "paged" for growing n.
C3   FLOPs per byte of a decode step vs a prefill from preset shapes, and the
     default model's measured time per token of each on this machine.
C7   one random workload through the Scheduler with 16-token pages and with
     max_model_len reservations; the seed's fragmentation example.
C11  KV tokens in a fixed pool with the MTP modules' layers cached or not:
     the ledger's arithmetic, and the bytes kvjax's Engine actually allocates.
C13  decode tok/s at batch 1: one jitted while_loop (kvjax.generate) vs a Python
     loop over the jitted step vs the same loop op by op (jax.disable_jit).
C17  total time cache="paged" vs "none" for independent short prompts as the
     output length grows: where the cache starts to pay.
Timed variants run once untimed (compiles), then in turn `repeats` times; the
median is reported, so load from other processes hits every variant alike
(os.getloadavg() is recorded per section).  Writes results/<name>.json and .png.
"""
import functools
import os
import subprocess
import time

from absl import app, logging
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from experiments import common
from experiments import mechanism_counts as counts
from kvjax.attention.dense import masked_attention, visibility_mask
from kvjax.caches import create_paged_cache
from kvjax.engine.engine import Engine
from kvjax.model.decoder import Attend, decoder, lm_logits
from kvjax.model.presets import get_preset
from kvjax.parallel import ledger
from kvjax.runtime import steps
from kvjax.runtime.generation import next_pow2
from kvjax.runtime.sampling import SamplingParams, sample
from kvjax.runtime.step_batch import make_step_batch

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/mechanism_bench.py", "experiment config", lock_config=True)


def _prompts(rng, num: int, length: int) -> list:
  return rng.integers(0, 256, (num, length)).tolist()  # byte ids of the default model


def _one_slot(model, pages: int, page_size: int):
  """Empty pages for one sequence and its block table [1, pages]: pages 1..pages in order."""
  cache = create_paged_cache(model.config, None, 1, 1 + pages, page_size, model.dtype)
  return cache, np.arange(1, pages + 1, dtype=np.int32)[None]


def _feed(model, cache, tables, token_ids, start: int, num_real: int):
  """One row feeding token_ids at positions start.. (num_real of them real)
  -> (cache, logits [1, V] at its last real column)."""
  batch = make_step_batch([token_ids], [start], [num_real], tables)
  return steps.prefill(model.params, cache, batch, config=model.config)[:2]


# -- C1 -------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config",))
def _forward_kv(params, tokens, *, config):
  """Full causal forward, no cache: tokens [1, T] -> (K, V [L, T, K, H], logits [T, V])."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
  valid = jnp.ones(tokens.shape, bool)

  def attend(kv, layer, q, k, v):
    visible = visibility_mask(positions, positions, valid, config.window_of_layer(layer))
    out = masked_attention(q, k, v, visible, sm_scale=config.head_dim ** -0.5)
    return kv + ((k[0], v[0]),), out

  kv, hidden = decoder(params, config, tokens, positions, (), Attend(attention=attend))
  return (jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv]),
          lm_logits(params, config, hidden[0]))


def _cached_run(model, prompt, new_tokens: int, page_size: int):
  """Prefill + greedy decode on one slot -> (tokens, K, V [L, S, K, H], logits [D+1, V])."""
  cfg = model.config
  bucket = next_pow2(len(prompt), 8)
  pages = -(-max(bucket, len(prompt) + new_tokens) // page_size)
  cache, tables = _one_slot(model, pages, page_size)
  tokens = np.zeros(bucket, np.int32)
  tokens[:len(prompt)] = prompt
  cache, logits = _feed(model, cache, tables, tokens, 0, len(prompt))
  seq, all_logits = list(prompt), [np.asarray(logits[0])]
  for _ in range(new_tokens):
    seq.append(int(np.argmax(all_logits[-1])))
    cache, logits = _feed(model, cache, tables, [seq[-1]], len(seq) - 1, 1)
    all_logits.append(np.asarray(logits[0]))

  def gather(pages_array):  # [L, K, P, Z, H] -> [L, S, K, H] in logical order
    x = np.asarray(pages_array)[:cfg.num_layers, :, 1:pages + 1]
    layers, kv_heads, _, _, h = x.shape
    return x.reshape(layers, kv_heads, -1, h).transpose(0, 2, 1, 3)[:, :len(seq)]

  return seq, gather(cache.k_pages), gather(cache.v_pages), np.stack(all_logits), bucket


def c1_bit_identity(model, c, rng) -> dict:
  prompt = _prompts(rng, 1, c.c1_prompt_len)[0]
  seq, k, v, logits, bucket = _cached_run(model, prompt, c.c1_new_tokens, c.page_size)
  n_prompt = len(prompt)
  out = {"prompt_len": n_prompt, "new_tokens": c.c1_new_tokens, "prefill_bucket": bucket}
  for name, width in (("same_shape", bucket), ("unpadded", len(seq))):
    tokens = np.zeros((1, max(width, len(seq))), np.int32)
    tokens[0, :len(seq)] = seq
    fk, fv, fl = (np.asarray(x) for x in _forward_kv(model.params, jnp.asarray(tokens),
                                                     config=model.config))
    fk, fv = fk[:, :len(seq)], fv[:, :len(seq)]
    diff = lambda a, b, s: float(np.abs(a[:, s] - b[:, s]).max())
    prompt_rows, decode_rows = slice(0, n_prompt), slice(n_prompt, len(seq))
    out[name] = {
        "full_forward_len": tokens.shape[1],
        "prefill_kv_max_abs_diff_per_layer": [
            max(diff(k[l:l + 1], fk[l:l + 1], prompt_rows),
                diff(v[l:l + 1], fv[l:l + 1], prompt_rows)) for l in range(len(k))],
        "decode_kv_max_abs_diff": max(diff(k, fk, decode_rows), diff(v, fv, decode_rows)),
        "decode_kv_max_rel_diff": max(diff(k, fk, decode_rows), diff(v, fv, decode_rows)) /
                                  float(max(np.abs(fk).max(), np.abs(fv).max())),
        "logits_max_abs_diff": float(np.abs(logits - fl[n_prompt - 1:len(seq)]).max()),
    }
  prompts = _prompts(rng, c.c1_num_prompts, c.c1_prompt_len)
  paged = kvjax.generate(model, prompts, c.c1_new_tokens, cache="paged").tokens
  none = kvjax.generate(model, prompts, c.c1_new_tokens, cache="none").tokens
  out["greedy_tokens_equal_paged_vs_none"] = paged == none
  return out


# -- C2 -------------------------------------------------------------------------


def c2_attention_work(model, c, rng) -> dict:
  n_seed = 512
  entries, pairs = counts.score_entries(n_seed), counts.kv_pairs(c.c2_pairs_n)
  out = {"counted": {
      "n": n_seed, "score_entries": entries,
      "score_ratio": entries["no_cache"] / entries["cache"],
      "score_ratio_causal_only": entries["no_cache_causal"] / entries["cache"],
      "pairs_n": c.c2_pairs_n, "kv_pairs": pairs, "pairs_ratio": pairs["no_cache"] / pairs["cache"],
      "seed000_no_cache_1000_over_100":
          counts.kv_pairs(1000)["no_cache"] / counts.kv_pairs(100)["no_cache"],
      "seed000_cache_1000_over_100": counts.kv_pairs(1000)["cache"] / counts.kv_pairs(100)["cache"],
  }}
  prompt = _prompts(rng, 1, c.c2_prompt_len)
  timed = []
  for n in c.c2_new_tokens:
    logging.info("C2: %d new tokens, cache none vs paged", n)
    median = common.interleaved({
        cache: functools.partial(kvjax.generate, model, prompt, n, cache=cache)
        for cache in ("paged", "none")}, c.repeats).medians()
    e = counts.score_entries(n + c.c2_prompt_len)
    timed.append(dict(n=n, paged_s=median["paged"], none_s=median["none"],
                      time_ratio=median["none"] / median["paged"],
                      counted_score_ratio=e["no_cache"] / e["cache"]))
  ns = np.array([r["n"] for r in timed], float)
  ratios = np.array([r["time_ratio"] for r in timed])
  slope, intercept = np.polyfit(ns, ratios, 1)
  out["timed"] = timed
  out["time_ratio_linear_fit"] = {"slope_per_token": slope, "intercept": intercept,
                                  "r2": float(np.corrcoef(ns, ratios)[0, 1] ** 2)}
  return out


# -- C3 -------------------------------------------------------------------------


def c3_intensity(model, c, rng) -> dict:
  presets = {}
  for name in c.c3_presets:
    cfg = get_preset(name)
    presets[name] = {
        "decode": {str(n): counts.step_cost(cfg, n, 1, 2) for n in c.c3_contexts},
        "prefill": counts.step_cost(cfg, 0, c.c3_preset_prefill_len, 2)}
  cfg, p_len = model.config, c.c3_prompt_len
  bytes_per_value = np.dtype(model.dtype).itemsize
  decode_cost = counts.step_cost(cfg, p_len + c.c3_new_tokens // 2, 1, bytes_per_value)
  prefill_cost = counts.step_cost(cfg, 0, p_len, bytes_per_value)
  prompt = _prompts(rng, 1, p_len)
  runs = common.interleaved({"generate": lambda: kvjax.generate(
      model, prompt, c.c3_new_tokens).stats}, c.repeats).results["generate"]
  ttft = common.median([r["ttft_s"] for r in runs])
  tpot = common.median([r["tpot_s"] for r in runs])
  return {"presets": presets, "ridge_flops_per_byte": c.c3_ridge_flops_per_byte,
          "default_model": {
              "prompt_len": p_len, "decode_cost": decode_cost, "prefill_cost": prefill_cost,
              "prefill_s_per_token": ttft / p_len, "decode_s_per_token": tpot,
              "decode_over_prefill_per_token": tpot / (ttft / p_len),
              "prefill_gflops_per_s": prefill_cost["flops"] / ttft / 1e9,
              "decode_gflops_per_s": decode_cost["flops"] / tpot / 1e9,
              "decode_gbytes_per_s": (decode_cost["weight_bytes"] + decode_cost["kv_bytes"])
                                     / tpot / 1e9}}


# -- C7 -------------------------------------------------------------------------


def c7_allocation(c) -> dict:
  workload = counts.lognormal_workload(c.c7_num_requests, c.c7_prompt_median,
                                       c.c7_output_median, c.c7_sigma, c.c7_max_model_len, c.seed)
  lengths = np.array([p + o for p, o in workload])
  runs = {}
  for name, page_size in (("paged", c.page_size), ("contiguous", c.c7_max_model_len)):
    logging.info("C7: simulating %s (page %d)", name, page_size)
    runs[name] = counts.simulate_pool(
        workload, pool_tokens=c.c7_pool_tokens, page_size=page_size,
        max_model_len=c.c7_max_model_len, max_num_batched_tokens=c.c7_max_num_batched_tokens)
  return {"workload": {"num_requests": len(workload), "mean_total_len": float(lengths.mean()),
                       "p95_total_len": float(np.percentile(lengths, 95)),
                       "max_model_len": c.c7_max_model_len, "pool_tokens": c.c7_pool_tokens},
          **runs,
          "throughput_ratio": runs["paged"]["output_tokens_per_step"] /
                              runs["contiguous"]["output_tokens_per_step"],
          "fragmentation": counts.fragmentation_trace(page_size=c.page_size)}


# -- C11 ------------------------------------------------------------------------


def _engine_kv_bytes_per_token(model, speculative, c) -> float:
  """Bytes of KV pages the Engine allocates per pool token, and its draft workspace."""
  engine = Engine(model, page_size=c.page_size, num_pages=c.c11_engine_pages,
                  max_num_seqs=1, max_model_len=c.page_size * 4, speculative=speculative)
  cache = engine.state.cache
  page_bytes = sum(getattr(cache, n).nbytes for n in cache.PAGE_ARRAYS
                   if getattr(cache, n) is not None)
  return page_bytes / (c.c11_engine_pages * c.page_size), engine.state.draft_probs.nbytes


def c11_mtp_pool(model, c) -> dict:
  seed_cfg = get_preset(c.c11_seed_preset)
  pool = c.c11_seed_pool_tokens * ledger.kv_bytes_per_token(seed_cfg, "bf16")
  seed_model = counts.mtp_pool_tokens(seed_cfg, pool)
  reserved = counts.mtp_reserved_bytes(seed_cfg, c.c11_seed_max_num_seqs, c.c11_num_draft)
  per_token = ledger.kv_bytes_per_token(seed_cfg, "bf16", include_mtp=True)
  explained = seed_model["on"] - sum(reserved.values()) // per_token
  dtype = {4: "fp32", 2: "bf16"}[np.dtype(model.dtype).itemsize]
  engine_off, probs_off = _engine_kv_bytes_per_token(model, None, c)
  engine_on, probs_on = _engine_kv_bytes_per_token(model, "mtp", c)
  budget = c.c11_budget_mib * 2**20
  return {
      "seed_preset": {"preset": seed_cfg.name, "pool_bytes": pool, **seed_model,
                      "reserved_bytes": reserved, "tokens_with_everything_modelled": explained,
                      "change_with_everything_modelled": explained / seed_model["off"] - 1,
                      "seed_on": c.c11_seed_pool_on, "seed_change": c.c11_seed_pool_on /
                      c.c11_seed_pool_tokens - 1},
      "deepseek_v3_like": counts.mtp_pool_tokens(counts.deepseek_v3_like(), pool),
      "default_model_ledger": counts.mtp_pool_tokens(model.config, budget, dtype),
      "default_model_engine": {
          "budget_mib": c.c11_budget_mib,
          "kv_bytes_per_token_mtp_off": engine_off, "kv_bytes_per_token_mtp_on": engine_on,
          "tokens_mtp_off": int(budget // engine_off), "tokens_mtp_on": int(budget // engine_on),
          "draft_probs_bytes_off": probs_off, "draft_probs_bytes_on": probs_on}}


# -- C13 ------------------------------------------------------------------------


def _step_loop(model, prompt, new_tokens: int, page_size: int):
  """Prefill, then one jitted decode step + sample per token from Python -> (tokens, s/token)."""
  cache, tables = _one_slot(model, -(-(len(prompt) + new_tokens) // page_size), page_size)
  greedy = SamplingParams.make(1)
  cache, logits = _feed(model, cache, tables, prompt, 0, len(prompt))
  length = len(prompt)
  token = sample(logits, greedy, jnp.asarray([length]), use_filter=False)
  out = [token]
  token.block_until_ready()
  start = time.perf_counter()
  for _ in range(new_tokens - 1):
    # The host owns the length; the row's token stays on the device.
    batch = make_step_batch(token[:, None], [length], [1], tables)
    cache, logits, _ = steps.prefill(model.params, cache, batch, config=model.config)
    length += 1
    token = sample(logits, greedy, jnp.asarray([length]), use_filter=False)
    out.append(token)
  token.block_until_ready()
  return [int(t[0]) for t in out], (time.perf_counter() - start) / (new_tokens - 1)


def c13_dispatch(model, c, rng) -> dict:
  # A config of its own: no program compiled by another section is reused, so the
  # first call's extra time is this section's compilation.
  model = kvjax.Model(model.config.replace(name=model.config.name + "-c13"), model.params,
                      model.dtype)
  prompt = _prompts(rng, 1, c.c13_prompt_len)
  n = c.c13_new_tokens
  # The first (untimed) call of each is its compilation plus one run.
  timed = common.interleaved({"generate": lambda: kvjax.generate(model, prompt, n),
                              "step_loop": lambda: _step_loop(model, prompt[0], n, c.page_size)},
                             c.repeats)
  reference = timed.first_results["generate"].tokens[0]
  tokens = timed.results["step_loop"][-1][0]
  gen_tpot = [out.stats["tpot_s"] for out in timed.results["generate"]]
  loop_tpot = [tpot for _, tpot in timed.results["step_loop"]]
  with jax.disable_jit():
    _step_loop(model, prompt[0], 2, c.page_size)  # per-op programs compile here
    eager_tokens, eager_tpot = _step_loop(model, prompt[0], c.c13_eager_tokens, c.page_size)
  t_while, t_loop = common.median(gen_tpot), common.median(loop_tpot)
  walls = timed.medians()
  return {
      "prompt_len": c.c13_prompt_len, "new_tokens": n,
      "tokens_per_s": {"jit_while_loop": 1 / t_while, "jit_step_python_loop": 1 / t_loop,
                       "op_by_op": 1 / eager_tpot},
      "while_loop_over_step_loop": t_loop / t_while,
      "while_loop_over_op_by_op": eager_tpot / t_while,
      "compile_s": {name: timed.first_seconds[name] - walls[name] for name in walls},
      "tokens_equal": {"step_loop": tokens == reference,
                       "op_by_op": eager_tokens == reference[:len(eager_tokens)]}}


# -- C17 ------------------------------------------------------------------------


def c17_crossover(model, c, rng) -> dict:
  out = {}
  for p_len in c.c17_prompt_lens:
    prompts = _prompts(rng, c.c17_batch, p_len)
    rows = []
    for n in c.c17_new_tokens:
      logging.info("C17: prompt %d, %d new tokens", p_len, n)
      median = common.interleaved({
          cache: functools.partial(kvjax.generate, model, prompts, n, cache=cache)
          for cache in ("paged", "none")}, c.repeats).medians()
      rows.append(dict(new_tokens=n, paged_s=median["paged"], none_s=median["none"],
                       none_over_paged=median["none"] / median["paged"]))
    paying = [r["new_tokens"] for r in rows if r["none_over_paged"] > 1]
    out[f"prompt_{p_len}"] = {"rows": rows, "cache_pays_from": paying[0] if paying else None}
  return out


# -- table, plot, main ----------------------------------------------------------


def _table(r: dict, c) -> list:
  rows = []
  if "c1" in r:
    same, unpadded = r["c1"]["same_shape"], r["c1"]["unpadded"]
    rows += [
        ("C1", f"prefill K/V vs full forward, same T={same['full_forward_len']}: max|diff|",
         "0 (bit-identical)", f"{max(same['prefill_kv_max_abs_diff_per_layer']):.3g}"),
        ("C1", f"prefill K/V vs unpadded full forward T={unpadded['full_forward_len']} (attention "
         f"sums over fewer keys), per layer", "0",
         " ".join(f"{d:.2g}" for d in unpadded["prefill_kv_max_abs_diff_per_layer"])),
        ("C1", "decode K/V (T=1 matmuls) vs full forward: max|diff| (rel)", "0",
         f"{same['decode_kv_max_abs_diff']:.2g} ({same['decode_kv_max_rel_diff']:.1g})"),
        ("C1", "decode logits vs full-forward logits: max|diff|", "0",
         f"{same['logits_max_abs_diff']:.2g}"),
        ("C1", "greedy tokens, paged cache vs no cache", "identical",
         "identical" if r["c1"]["greedy_tokens_equal_paged_vs_none"] else "DIFFER")]
  if "c2" in r:
    k, timed = r["c2"]["counted"], r["c2"]["timed"]
    rows += [
        ("C2", "score entries no cache / cache, n=512 (counted)", "341.7x",
         f"{k['score_ratio']:.1f}x (causal-only {k['score_ratio_causal_only']:.1f}x)"),
        ("C2", f"K/V pairs no cache / cache, n={k['pairs_n']} (counted)", "7.5x",
         f"{k['pairs_ratio']:.1f}x"),
        ("C2", "seed 000: recompute cost 1000 tokens / 100 tokens", "100x (cache: 10x)",
         f"{k['seed000_no_cache_1000_over_100']:.1f}x (cache: "
         f"{k['seed000_cache_1000_over_100']:.0f}x)"),
        ("C2", "time no cache / paged, n = " + ",".join(str(t["n"]) for t in timed),
         "grows ~linearly (2n/3 attention)", " ".join(f"{t['time_ratio']:.1f}x" for t in timed))]
  if "c3" in r:
    for name, p in r["c3"]["presets"].items():
      d = p["decode"]
      rows.append(("C3", f"{name} bf16 attention decode FLOP per KV byte, n=" + ",".join(d),
                   "~1, independent of n",
                   " ".join(f"{v['attention_flops_per_kv_byte']:.2f}" for v in d.values())))
      first, last = list(d)[0], list(d)[-1]
      rows.append(("C3", f"{name} FLOP/B decode n={first}..{last} vs prefill "
                   f"{c.c3_preset_prefill_len} (ridge {c.c3_ridge_flops_per_byte})",
                   "decode << ridge < prefill",
                   f"{d[first]['intensity']:.2f}..{d[last]['intensity']:.2f} vs "
                   f"{p['prefill']['intensity']:.0f}"))
    m = r["c3"]["default_model"]
    rows.append(("C3", f"default model, CPU: decode / prefill time per token (prompt "
                 f"{m['prompt_len']})", "decode >> prefill per token",
                 f"{m['decode_over_prefill_per_token']:.1f}x ({m['decode_gflops_per_s']:.1f} vs "
                 f"{m['prefill_gflops_per_s']:.1f} GFLOP/s)"))
  if "c7" in r:
    s = r["c7"]
    f = s["fragmentation"]
    rows += [
        ("C7", "KV utilization of reserved memory: contiguous max-len / paged", "<50% / >90%",
         f"{s['contiguous']['utilization']:.1%} / {s['paged']['utilization']:.1%}"),
        ("C7", "waste: contiguous / paged", "~60% / ~4%",
         f"{1 - s['contiguous']['utilization']:.1%} / {1 - s['paged']['utilization']:.1%}"),
        ("C7", "mean concurrent requests, same pool: paged / contiguous", "-",
         f"{s['paged']['mean_running']:.1f} / {s['contiguous']['mean_running']:.1f}"),
        ("C7", "throughput (output tokens per step) paged / contiguous", "2-4x",
         f"{s['throughput_ratio']:.2f}x"),
        ("C7", "fragmentation: free in holes, contiguous 2x-request fits?", "8 GB free, no 2 GB",
         f"{f['free_tokens']} tokens in {f['num_holes']} holes, {f['request_tokens']}-token "
         f"request: contiguous {'fits' if f['contiguous_fits'] else 'fails'}, paged "
         f"{f['paged_pages']} pages")]
  if "c11" in r:
    s, e = r["c11"]["seed_preset"], r["c11"]["default_model_engine"]
    led, ds = r["c11"]["default_model_ledger"], r["c11"]["deepseek_v3_like"]
    rows += [
        ("C11", f"KV pool tokens MTP off -> on, {s['preset']} (MTP layer's KV only)",
         f"{c.c11_seed_pool_tokens:,} -> {c.c11_seed_pool_on:,} ({s['seed_change']:.0%})",
         f"{s['off']:,} -> {s['on']:,} ({s['change']:.1%})"),
        ("C11", f"same, + MTP weights and draft/verify workspace (max_num_seqs "
         f"{c.c11_seed_max_num_seqs})", f"{s['seed_change']:.0%}",
         f"-> {s['tokens_with_everything_modelled']:,} "
         f"({s['change_with_everything_modelled']:.1%})"),
        ("C11", "deepseek-v3-like (61 MLA layers + 1 MTP)", "-", f"{ds['change']:.1%}"),
        ("C11", "default model, ledger (4 layers + 2 MTP)", "-", f"{led['change']:.1%}"),
        ("C11", f"default model, Engine-allocated tokens in {e['budget_mib']} MiB: off / on",
         "fewer with MTP", f"{e['tokens_mtp_off']:,} / {e['tokens_mtp_on']:,}"
         + (" (MTP pages allocated even with MTP off)"
            if e["tokens_mtp_off"] == e["tokens_mtp_on"] else ""))]
  if "c13" in r:
    s = r["c13"]
    tps = s["tokens_per_s"]
    rows += [
        ("C13", "decode tok/s batch 1: jitted while_loop vs Python loop of jitted step",
         "46.1 vs 41 (+12.5%)", f"{tps['jit_while_loop']:.0f} vs {tps['jit_step_python_loop']:.0f}"
         f" ({s['while_loop_over_step_loop'] - 1:+.0%})"),
        ("C13", "jitted while_loop vs op-by-op (jax.disable_jit)", "+12.5%",
         f"{tps['jit_while_loop']:.0f} vs {tps['op_by_op']:.1f} tok/s "
         f"({s['while_loop_over_op_by_op']:.0f}x)"),
        ("C13", "capture / compile seconds (generate; step loop)", "19.7 s",
         f"{s['compile_s']['generate']:.1f} s; {s['compile_s']['step_loop']:.1f} s")]
  if "c17" in r:
    for key, s in r["c17"].items():
      rows.append(("C17", f"time none / paged, batch {c.c17_batch}, {key}, new tokens "
                   + ",".join(str(x["new_tokens"]) for x in s["rows"]),
                   "cache not worth it for tiny outputs",
                   " ".join(f"{x['none_over_paged']:.2f}" for x in s["rows"])
                   + f"; cache pays from {s['cache_pays_from']}"))
  return common.claim_rows(rows)


def _plot(r: dict, path: str):
  with common.figure(path, 2, 3, figsize=(16, 8)) as (_, axes):
    _draw(r, axes)


def _draw(r: dict, axes):
  ax = axes[0, 0]
  if "c2" in r:
    t = r["c2"]["timed"]
    ax.plot([x["n"] for x in t], [x["time_ratio"] for x in t], "o-", label="measured time")
    ax.plot([x["n"] for x in t], [x["counted_score_ratio"] for x in t], "s--",
            label="counted score entries")
    ax.set(xlabel="new tokens n", ylabel="no cache / paged", yscale="log",
           title="C2: cost of recomputing")
    ax.legend()
  ax = axes[0, 1]
  if "c3" in r:
    for name, p in r["c3"]["presets"].items():
      ctx = [int(n) for n in p["decode"]]
      ax.plot(ctx, [v["intensity"] for v in p["decode"].values()], "o-", label=f"{name} decode")
      ax.axhline(p["prefill"]["intensity"], ls=":", label=f"{name} prefill", color="gray")
    ax.axhline(r["c3"]["ridge_flops_per_byte"], color="red", label="ridge (config)")
    ax.set(xscale="log", yscale="log", xlabel="context", ylabel="FLOP / byte",
           title="C3: arithmetic intensity")
    ax.legend(fontsize=7)
  ax = axes[0, 2]
  if "c7" in r:
    s = r["c7"]
    names = ["contiguous", "paged"]
    ax.bar(names, [s[n]["utilization"] for n in names], label="of reserved")
    ax.bar(names, [s[n]["pool_utilization"] for n in names], 0.4, label="of pool")
    ax.set(ylabel="KV utilization", ylim=(0, 1),
           title=f"C7: throughput {s['throughput_ratio']:.2f}x paged")
    ax.legend()
  ax = axes[1, 0]
  if "c11" in r:
    s, led = r["c11"]["seed_preset"], r["c11"]["default_model_ledger"]
    labels = [f"{s['preset']}\nseed", f"{s['preset']}\nours", "default\nledger"]
    ax.bar(labels, [s["seed_change"], s["change"], led["change"]])
    ax.set(ylabel="pool tokens change with MTP", title="C11: MTP memory")
  ax = axes[1, 1]
  if "c13" in r:
    tps = r["c13"]["tokens_per_s"]
    ax.bar(list(tps), list(tps.values()))
    ax.set(yscale="log", ylabel="decode tok/s (batch 1)", title="C13: dispatch")
    ax.tick_params(axis="x", labelsize=7)
  ax = axes[1, 2]
  if "c17" in r:
    for key, s in r["c17"].items():
      ax.plot([x["new_tokens"] for x in s["rows"]], [x["none_over_paged"] for x in s["rows"]],
              "o-", label=key)
    ax.axhline(1, color="gray", ls=":")
    ax.set(xscale="log", xlabel="new tokens", ylabel="time no cache / paged",
           title="C17: when the cache pays")
    ax.legend()


def _code_version() -> dict:
  """The commit measured, and files of the working tree that differ from it."""
  git = lambda *args: subprocess.run(("git",) + args, capture_output=True, text=True).stdout
  return {"commit": git("rev-parse", "HEAD").strip(),
          "uncommitted": git("status", "--porcelain", "--untracked-files=no").splitlines()}


def main(argv):
  del argv
  c = _CONFIG.value
  model = kvjax.load_checkpoint(c.checkpoint or None)
  # EOS off: every run generates exactly the tokens asked for.
  model = kvjax.Model(model.config.replace(eos_token_id=None), model.params, model.dtype)
  rng = np.random.default_rng(c.seed)
  sections = {"c1": lambda: c1_bit_identity(model, c, rng),
              "c2": lambda: c2_attention_work(model, c, rng),
              "c3": lambda: c3_intensity(model, c, rng), "c7": lambda: c7_allocation(c),
              "c11": lambda: c11_mtp_pool(model, c), "c13": lambda: c13_dispatch(model, c, rng),
              "c17": lambda: c17_crossover(model, c, rng)}
  unknown = set(c.sections) - set(sections)
  if unknown:
    raise ValueError(f"unknown sections {sorted(unknown)}; use some of {sorted(sections)}")
  device = common.describe_device()
  results = {"device": common.device_label(device),
             "machine": device["os"], "jax": device["jax"], "code": _code_version(),
             "model": model.config.name, "config": c.to_dict(), "loadavg": {}, "seconds": {}}
  for name in c.sections:
    logging.info("section %s", name)
    start, load = time.perf_counter(), os.getloadavg()
    results[name] = sections[name]()
    results["seconds"][name] = time.perf_counter() - start
    results["loadavg"][name] = {"start": load, "end": os.getloadavg()}
  results["table"] = _table(results, c)
  print(f"mechanism_bench on {results['device']}, model {model.config.name}, "
        f"loadavg {os.getloadavg()}")
  common.print_claims(results["table"], "{claim:<5} {what:<78} {seed:<34} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))


if __name__ == "__main__":
  app.run(main)
