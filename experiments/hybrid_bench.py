"""Hybrid linear-attention models (issue 15): prefix hits at 16-token pages (C8), chunked
vs recurrent prefill, and what the state snapshots cost (C4).

(1) Multi-turn chats (kvjax/cli/bench.py) on a tiny random-init hybrid of
    Qwen3.5's layout ((3 Gated DeltaNet + 1 full attention) x groups) through
    warm Engines, greedy:
      pages_16   16-token pages, the recurrent state snapshotted at every page
                 boundary (kvjax/engine/sched/state_snapshots.py; the default),
      grown      the seed's / vLLM's hybrid allocator: pages grown until one
                 page's KV is as big as one request's state (the smallest power
                 of two >= state bytes / KV bytes per token), a state per page,
      no_cache   prefix_cache=False.
    Prefix hit rate and mean TTFT of the turns after the first; every round's
    outputs must equal no_cache's token for token (a hit resumes exactly).
    Probes: two requests sharing a 30- and a 40-token prefix, the second's hit
    tokens measured per engine and worked out for qwen3.5-9b's grown block.
(2) One Gated DeltaNet layer at qwen3.5-9b's dims (Nv value heads, Hk = Hv),
    batch 1, from a zero state: delta_rule_chunked (chunk = linear_chunk_size)
    against delta_rule_step scanned over T, both jitted, compile excluded;
    outputs must agree within prefill_tolerance.
(3) qwen3.5-9b's per-snapshot bytes in the engine's allocated pool
    (kvjax/cli/memory.py) and what the default bound costs.
Timed variants run once untimed (compiles), then in turn `repeats` times
(common.interleaved); the median is reported, so load from other processes hits
every variant alike.  Prints claim id, seed value and ours; writes
results/<name>.json and .png.
"""
import functools
import math
import os
import time

from absl import app, logging
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from experiments import common
from kvjax.attention.gated_delta import delta_rule_chunked, delta_rule_step
from kvjax.cli import bench as cli_bench
from kvjax.cli import memory as cli_memory
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.model.params import init_params
from kvjax.model.presets import get_preset
from kvjax.parallel import ledger
from kvjax.runtime.generation import next_pow2
from kvjax.server.bench import workloads as bench_workloads

_PROBE_TAIL = 8  # prompt tokens after a probe's shared prefix, different per request


def grown_block(cfg: kvjax.ModelConfig, dtype: str) -> dict:
  """The grown-block design's page: the smallest power of two of tokens whose KV
  holds at least one request's recurrent state (vLLM's hybrid allocator)."""
  state = ledger.state_bytes_per_request(cfg, dtype)
  kv = ledger.kv_bytes_per_token(cfg, dtype)
  return {"state_bytes_per_request": state, "kv_bytes_per_token": kv,
          "state_over_kv_tokens": state / kv, "block_tokens": next_pow2(math.ceil(state / kv))}


def whole_block_hit(shared: int, block: int) -> int:
  """Tokens a request sharing `shared` prompt tokens reuses: whole blocks only (C8)."""
  return shared // block * block


# -- (1) prefix caching ---------------------------------------------------------


def tiny_hybrid(c) -> kvjax.Model:
  cfg = kvjax.ModelConfig(
      name="tiny-hybrid-bench", vocab_size=256, hidden_size=c.hidden_size,
      intermediate_size=2 * c.hidden_size, num_layers=4 * c.groups, num_heads=c.num_heads,
      num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, max_position_embeddings=1024,
      qk_norm=True, layer_types=(("linear_attention",) * 3 + ("full_attention",)) * c.groups,
      linear_num_key_heads=c.linear_num_key_heads,
      linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_head_dim,
      linear_value_head_dim=c.linear_head_dim, linear_chunk_size=c.linear_chunk_size,
      attn_output_gate=True, partial_rotary_factor=0.5, mtp_num_hidden_layers=2)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(c.seed), std=0.2))


def _serve(engine, sessions) -> dict:
  """The sessions on a warm engine, its prefix cache emptied first (a repeat must not hit
  the run before)."""
  for cache in engine.prefix_caches():
    cache.reset()
  return cli_bench.run_workload(engine, sessions)


def _shared_prefix_hit(engine, shared: int, seed: int) -> int:
  """Hit tokens of a request sharing `shared` prompt tokens with one served before it
  (the same random prompts for every engine, given the seed)."""
  caches = engine.prefix_caches()
  if not caches:
    return 0
  for cache in caches:
    cache.reset()
  rng = np.random.default_rng(seed)
  prefix = rng.integers(3, engine.model_config.vocab_size, shared).tolist()
  first, second = (prefix + rng.integers(3, engine.model_config.vocab_size,
                                         _PROBE_TAIL).tolist()
                   for _ in range(2))
  engine.generate([first], 1)
  before = engine.stats().prefix_hit_tokens
  engine.generate([second], 1)
  return engine.stats().prefix_hit_tokens - before


def section_prefix(c) -> dict:
  model = tiny_hybrid(c)
  grown = grown_block(model.config, "fp32")  # the model's dtype: float32 states and KV
  logging.info("tiny hybrid: state %d B / KV %d B per token = %.1f tokens -> %d-token blocks",
               grown["state_bytes_per_request"], grown["kv_bytes_per_token"],
               grown["state_over_kv_tokens"], grown["block_tokens"])
  sessions = bench_workloads.make_workload(
      "multi-turn-chat", vocab_size=model.config.vocab_size, num_requests=c.chat_num_chats,
      input_len=c.chat_user_len, output_len=c.chat_output_len, num_turns=c.chat_num_turns,
      seed=c.seed)
  longest = max(c.chat_num_turns * (c.chat_user_len + c.chat_output_len),
                max(c.shared_prefix_lens) + _PROBE_TAIL + 1)
  base = dict(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
              max_model_len=longest)
  variants = {"pages_16": dict(page_size=c.page_size),
              "grown": dict(page_size=grown["block_tokens"]),
              "no_cache": dict(page_size=c.page_size, prefix_cache=False)}
  engines = {name: Engine(model, EngineConfig(**base, **kw)) for name, kw in variants.items()}
  logging.info("prefix: %d chats x %d turns on %s", c.chat_num_chats, c.chat_num_turns,
               list(engines))
  timings = common.interleaved({name: functools.partial(_serve, e, sessions)
                                for name, e in engines.items()}, c.repeats)
  runs = timings.median_results(key=lambda run: run["wall_s"])
  reference = timings.first_results["no_cache"]["outputs"]
  out = {"model": model.config.name, "grown_block": grown, "variants": {}}
  for name, run in runs.items():
    every_round = [timings.first_results[name]] + timings.results[name]
    out["variants"][name] = {
        "page_size": engines[name].config.page_size,
        "prefix_snapshots": engines[name].config.prefix_snapshots,
        "prefix_hit_rate": run["prefix_hit_rate"], "prefix_hit_tokens": run["prefix_hit_tokens"],
        "turn_ttft_s": run["turn_ttft_s"], "turn_prompt_tokens": run["turn_prompt_tokens"],
        "later_turns_ttft_mean_s": float(np.mean(run["turn_ttft_s"][1:])),
        "tokens_per_s": run["tokens_per_s"], "wall_s": run["wall_s"],
        "outputs_equal_no_cache": all(r["outputs"] == reference for r in every_round),
        "shared_prefix_hit_tokens": {str(n): _shared_prefix_hit(engines[name], n, c.seed + n)
                                     for n in c.shared_prefix_lens}}
  seed_grown = grown_block(get_preset(c.seed_preset), "bf16")
  out["seed_preset"] = {
      "preset": c.seed_preset, **seed_grown,
      "shared_prefix_hit_tokens": {str(n): {
          "pages_16": whole_block_hit(n, c.page_size),
          "grown": whole_block_hit(n, seed_grown["block_tokens"])}
          for n in c.shared_prefix_lens}}
  return out


# -- (2) chunked vs recurrent prefill -------------------------------------------


def _layer_inputs(t: int, nv: int, hk: int, hv: int, seed: int):
  """One layer's rule inputs as the layer hands them over: q, k L2-normalized (q scaled),
  g <= 0, beta in (0, 1), a zero entering state (a prefill)."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(1, t, nv, hk))) * hk ** -0.5
  k = unit(rng.normal(size=(1, t, nv, hk)))
  v = rng.normal(size=(1, t, nv, hv))
  g = -rng.uniform(0.001, 0.2, size=(1, t, nv))
  beta = rng.uniform(0.05, 0.95, size=(1, t, nv))
  return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)] + [
      jnp.zeros((1, nv, hk, hv), jnp.float32)]


@functools.partial(jax.jit, static_argnames=("chunk",))
def _chunked(q, k, v, g, beta, state, *, chunk):
  return delta_rule_chunked(q, k, v, g, beta, state, chunk)


@jax.jit
def _recurrent(q, k, v, g, beta, state):
  """delta_rule_step token by token: [B, T, ...] inputs -> (o [B, T, Nv, Hv], state)."""
  def step(state, xs):
    out, state = delta_rule_step(*xs, state)
    return state, out

  state, out = jax.lax.scan(step, state, [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)])
  return jnp.moveaxis(out, 0, 1), state


def section_prefill(c) -> dict:
  cfg = get_preset(c.seed_preset)
  nv, hk, hv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
  out = {"preset": c.seed_preset, "num_value_heads": nv, "key_head_dim": hk,
         "value_head_dim": hv, "chunk": cfg.linear_chunk_size, "by_len": {}}
  for t in c.prefill_lens:
    logging.info("prefill: T = %d, chunked (chunk %d) vs recurrent", t, cfg.linear_chunk_size)
    inputs = _layer_inputs(t, nv, hk, hv, c.seed)
    timings = common.interleaved({
        "chunked": lambda: _chunked(*inputs, chunk=cfg.linear_chunk_size),
        "recurrent": lambda: _recurrent(*inputs)}, c.prefill_repeats,
        block=jax.block_until_ready)
    ms = {name: s * 1e3 for name, s in timings.medians().items()}
    (o_c, s_c), (o_r, s_r) = timings.first_results["chunked"], timings.first_results["recurrent"]
    out["by_len"][str(t)] = {
        "ms": ms, "tokens_per_s": {name: t / (m / 1e3) for name, m in ms.items()},
        "speedup": ms["recurrent"] / ms["chunked"],
        "first_call_s": timings.first_seconds,
        "max_abs_diff_outputs": float(jnp.abs(o_c - o_r).max()),
        "max_abs_diff_state": float(jnp.abs(s_c - s_r).max())}
    out["by_len"][str(t)]["within_tolerance"] = (
        out["by_len"][str(t)]["max_abs_diff_outputs"] <= c.prefill_tolerance)
  return out


# -- (3) snapshot memory --------------------------------------------------------


def section_snapshots(c) -> dict:
  cfg = get_preset(c.seed_preset)
  pool = cli_memory.allocated_pool(cfg, "bf16", "bf16")
  bound = c.snapshots_per_request * c.snapshot_max_num_seqs
  total = bound * pool["snapshot_bytes"]
  return {"preset": c.seed_preset, "allocated_pool": pool,
          "ledger_state_bytes_per_request": ledger.state_bytes_per_request(cfg, "bf16"),
          "max_num_seqs": c.snapshot_max_num_seqs, "snapshots": bound,
          "snapshots_bytes": total, "snapshots_gib": total / ledger.GIB,
          "slot_states_bytes": c.snapshot_max_num_seqs * pool["state_bytes_per_slot"],
          "snapshots_as_kv_tokens": total / pool["kv_bytes_per_token"]}


# -- results --------------------------------------------------------------------


def _table(results: dict, c) -> list:
  """Claim rows; a row worked out from a model's shape alone (no run) carries
  "arithmetic": True, which experiments/report.py lists under no device."""
  mib = 2 ** 20
  p, prefill, s = results["prefix"], results["prefill"], results["snapshots"]
  v, seed, tiny, pool = p["variants"], p["seed_preset"], p["grown_block"], s["allocated_pool"]
  arithmetic = [
      *(("C8", f"{c.seed_preset}: {n}-token shared prefix hits (grown / 16-token pages)",
         "0 (blocks > 60 tokens)" if n == "30" else "-", f"{hit['grown']} / {hit['pages_16']}")
        for n, hit in seed["shared_prefix_hit_tokens"].items()),
      ("C8", f"{c.seed_preset} grown block (pow2 >= state / KV per token), tokens", "> 60",
       f"{seed['block_tokens']:,} ({seed['state_bytes_per_request'] / mib:.1f} MiB / "
       f"{seed['kv_bytes_per_token'] / 1024:g} KiB = {seed['state_over_kv_tokens']:,.0f})"),
      ("C8", "tiny hybrid grown block: state / KV per token -> tokens", "-",
       f"{tiny['block_tokens']} ({tiny['state_bytes_per_request']:,} B / "
       f"{tiny['kv_bytes_per_token']} B = {tiny['state_over_kv_tokens']:.1f})"),
      ("C4", f"{c.seed_preset}: KV bytes per token (allocated pool)", "32.3 KB measured",
       f"{pool['kv_bytes_per_token']:,.0f} B"),
      ("C4", f"{c.seed_preset}: state per request / per snapshot (allocated)", "-",
       f"{pool['state_bytes_per_slot'] / mib:.1f} / {pool['snapshot_bytes'] / mib:.1f} MiB"),
      ("issue", f"default snapshot bound at max_num_seqs={s['max_num_seqs']}: "
       f"{s['snapshots']} snapshots", "-",
       f"{s['snapshots_gib']:.2f} GiB (= {s['snapshots_as_kv_tokens']:,.0f} KV tokens)")]
  measured = [
      *(("C8", f"tiny hybrid engine, {n}-token shared prefix: hit tokens pages_16 / grown / "
         f"no_cache (whole pages: {whole_block_hit(n, c.page_size)} / "
         f"{whole_block_hit(n, tiny['block_tokens'])} / 0)", "-",
         " / ".join(str(v[name]["shared_prefix_hit_tokens"][str(n)]) for name in v))
        for n in c.shared_prefix_lens),
      *(("C8", f"chats, {name} ({r['page_size']}-token pages): hit rate, TTFT ms turn 1 / "
         "later turns", "-", f"{r['prefix_hit_rate']:.1%}, {r['turn_ttft_s'][0] * 1e3:.1f} / "
         f"{r['later_turns_ttft_mean_s'] * 1e3:.1f}") for name, r in v.items()),
      ("issue", "greedy outputs pages_16 == grown == no_cache, every round", "yes",
       "yes" if v["pages_16"]["outputs_equal_no_cache"] and v["grown"]["outputs_equal_no_cache"]
       else "NO")]
  for t, r in prefill["by_len"].items():
    measured += [
        ("issue", f"{c.seed_preset} DeltaNet layer prefill T={t}: chunked / recurrent ms "
         "(tok/s), speedup", "-", f"{r['ms']['chunked']:.1f} / {r['ms']['recurrent']:.1f} ms "
         f"({r['tokens_per_s']['chunked']:,.0f} / {r['tokens_per_s']['recurrent']:,.0f}), "
         f"{r['speedup']:.1f}x"),
        ("issue", f"T={t}: max |chunked - recurrent| outputs", f"<= {c.prefill_tolerance}",
         f"{r['max_abs_diff_outputs']:.1e}")]
  return ([{**row, "arithmetic": True} for row in common.claim_rows(arithmetic)]
          + common.claim_rows(measured))


def _plot(results, path):
  with common.figure(path, 1, 2, figsize=(12, 4)) as (_, (chats, prefill)):
    for variant, r in results["prefix"]["variants"].items():
      turns = np.arange(1, len(r["turn_ttft_s"]) + 1)
      chats.plot(turns, np.asarray(r["turn_ttft_s"]) * 1e3, "o-",
                 label=f"{variant} ({r['page_size']}-token pages, hit {r['prefix_hit_rate']:.0%})")
    chats.set_xticks(turns)
    chats.set(xlabel="turn", ylabel="mean TTFT (ms)", title="(1) C8: chats on a tiny hybrid")
    by_len = results["prefill"]["by_len"]
    x = np.arange(len(by_len))
    for offset, key in ((-0.2, "chunked"), (0.2, "recurrent")):
      prefill.bar(x + offset, [r["tokens_per_s"][key] for r in by_len.values()], 0.4, label=key)
    prefill.set_xticks(x, [f"T={t}\n{r['speedup']:.1f}x" for t, r in by_len.items()])
    prefill.set(ylabel="prefill tokens/s (one layer)",
                title=f"(2) {results['prefill']['preset']} Gated DeltaNet layer")
    for ax in (chats, prefill):
      ax.legend()


def run(c) -> dict:
  """Every section, the claim table printed; writes <out_dir>/<name>.json and .png."""
  device = common.describe_device()
  results = {"device": common.device_label(device), "machine": device["os"],
             "jax": device["jax"], "config": c.to_dict(), "seconds": {}, "loadavg": {}}
  for name, section in (("prefix", section_prefix), ("prefill", section_prefill),
                        ("snapshots", section_snapshots)):
    logging.info("section %s", name)
    start, load = time.perf_counter(), os.getloadavg()
    results[name] = section(c)
    results["seconds"][name] = time.perf_counter() - start
    results["loadavg"][name] = {"start": load, "end": os.getloadavg()}
  results["table"] = _table(results, c)
  print(f"hybrid_bench on {results['device']}, loadavg {os.getloadavg()}")
  common.print_claims(results["table"], "{claim:<6} {what:<100} {seed:<24} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))
  return results


def main(argv):
  del argv
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined here, not at import: tests import this module beside other launchers,
  # and absl allows one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/hybrid_bench.py", "experiment config", lock_config=True)
  app.run(main)
