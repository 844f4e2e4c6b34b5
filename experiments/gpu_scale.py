"""Issue 16: a llama3-8b-shaped bf16 model on one GPU, end to end, in one run.

  python -m experiments.gpu_scale --config=configs/gpu_scale.py[:runlocal]

Sections (configs/gpu_scale.py budgets each; a failure is recorded and the rest go on):
  init        the model initialized on the device (jit out_shardings: no host copy)
  decode      batch-1 kvjax.generate tokens/s and model bandwidth utilization
              ((weight + KV bytes read per step) / step time / peak) per context
  steps       one decode step (q_len 1) vs verify (q_len 3) per batch (C9), batch 1 vs 10 (C14)
  quant       int8 / int4-g128 weights vs bf16, decode step per batch (C12)
  invariance  one request's logits alone (its batch padded, same shapes and tiling) vs
              inside a batch of mixed requests, bit for bit; also vs a batch of 1
  engine      kvjax.Engine on vLLM-style random workloads: throughput, TTFT / TPOT / ITL
  hf          the same weights in HF transformers on the same device (sdpa, static
              cache, torch.compile) on the engine's first requests
The JSON (<out_dir>/<name>.json) is rewritten after every section; claim rows and
the issue's goals are printed with the seed's values beside ours.
"""
from __future__ import annotations

import functools
import time
import traceback

from absl import app
from absl import logging
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.hf_peer import hf_generate, to_hf_on_device
import kvjax
from kvjax.caches import create_paged_cache
from kvjax.cli import bench as cli_bench
from kvjax.model.config import DTYPE_SHORT_NAMES
from kvjax.model.params import init_params
from kvjax.model.presets import get_preset
from kvjax.parallel import ledger
from kvjax.runtime import steps
from kvjax.runtime.generation import next_pow2
from kvjax.runtime.step_batch import make_step_batch
from kvjax.server.bench import workloads as bench_workloads
from kvjax.weights.quantize import decode_step_weight_bytes, quantize_params



def model_config(cfg):
  """The preset with cfg.model_overrides applied."""
  return get_preset(cfg.preset).replace(**cfg.model_overrides.to_dict())


def init_on_device(config, dtype, seed: int):
  """Random params built by one jitted program on the first device (nothing crosses the host)."""
  device = jax.devices()[0]
  init = jax.jit(functools.partial(init_params, config, dtype=dtype),
                 out_shardings=jax.sharding.SingleDeviceSharding(device))
  return jax.block_until_ready(init(jax.random.PRNGKey(seed)))


def step_bandwidth(weight_bytes: int, kv_bytes_per_token: int, context: float, batch: int,
                   step_s: float, peak: float) -> dict:
  """Bytes one decode step must read (weights once, every row's KV) over its time and the peak."""
  step_bytes = weight_bytes + kv_bytes_per_token * context * batch
  return dict(step_bytes=step_bytes, bytes_per_s=step_bytes / step_s,
              bandwidth_utilization=step_bytes / step_s / peak)


def _kv_bytes_per_token(model) -> int:
  return ledger.kv_bytes_per_token(model.config, DTYPE_SHORT_NAMES[jnp.dtype(model.dtype).name])


def _random_ids(rng, vocab_size: int, n: int) -> list:
  return [int(t) for t in rng.integers(3, vocab_size, n)]


# -- sections -------------------------------------------------------------------


def init_section(cfg, state):
  start = time.perf_counter()
  config, dtype = model_config(cfg), kvjax.api.resolve_dtype(cfg.dtype)
  state["model"] = kvjax.Model(config, init_on_device(config, dtype, cfg.seed), dtype)
  params = state["model"].params
  return dict(model=config.name, seconds=time.perf_counter() - start,
              num_params=sum(int(x.size) for x in jax.tree_util.tree_leaves(params)),
              decode_step_weight_bytes=decode_step_weight_bytes(params),
              kv_bytes_per_token=_kv_bytes_per_token(state["model"]),
              placement=str(jax.tree_util.tree_leaves(params)[0].sharding))


def decode_section(cfg, state):
  """Batch-1 generate at each context (prompt + new tokens); the KV term at the mean context."""
  model = state["model"]
  rng = np.random.default_rng(cfg.seed)
  weights, kv_per_token = decode_step_weight_bytes(model.params), _kv_bytes_per_token(model)
  rows = {}
  for context in cfg.decode_contexts:
    prompt = _random_ids(rng, model.config.vocab_size, context - cfg.decode_new_tokens)
    timed = common.interleaved({"generate": lambda: kvjax.generate(
        model, [prompt], cfg.decode_new_tokens, backend=cfg.backend,
        page_size=cfg.page_size)}, cfg.repeats)
    stats = [r.stats for r in timed.results["generate"]]
    tpot = common.median([s["tpot_s"] for s in stats])
    mean_context = len(prompt) + cfg.decode_new_tokens / 2
    rows[str(context)] = dict(
        prompt_len=len(prompt), mean_context=mean_context, tpot_s=tpot,
        tokens_per_s=1.0 / tpot, ttft_s=common.median([s["ttft_s"] for s in stats]),
        compile_run_s=timed.first_seconds["generate"],
        **step_bandwidth(weights, kv_per_token, mean_context, 1, tpot, cfg.peak_bandwidth))
    logging.info("decode ctx %d: %.1f tok/s, %.1f%% of peak bandwidth", context,
                 rows[str(context)]["tokens_per_s"],
                 100 * rows[str(context)]["bandwidth_utilization"])
  return rows


def _step_runner(cfg, model, params, batch: int, q_len: int):
  """A callable running one step program on rows holding cfg.step_context tokens each:
  q_len 1 is a decode step (steps.prefill of one token), more is steps.verify."""
  pages_per_row = -(-cfg.step_context // cfg.page_size)
  # Committed to the device like the step's output cache, so the second call hits the
  # first call's compiled program instead of compiling again.
  cache = jax.device_put(create_paged_cache(model.config, None, batch,
                                            1 + batch * pages_per_row, cfg.page_size,
                                            model.dtype), jax.devices()[0])
  tables = 1 + np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)
  step_batch = jax.device_put(make_step_batch(
      np.full((batch, q_len), 3), np.full(batch, cfg.step_context - q_len),
      np.full(batch, q_len), tables))
  step = steps.prefill if q_len == 1 else steps.verify
  held = [cache]  # the step donates its cache: each call runs on the last one's output

  def run():
    held[0], logits, _ = step(params, held[0], step_batch, config=model.config,
                              backend=cfg.backend)
    return logits

  return run


def _time_steps(cfg, runs: dict) -> dict:
  """name -> median step seconds, the runs interleaved round by round."""
  return common.interleaved(runs, cfg.step_repeats, block=jax.block_until_ready).medians()


def steps_section(cfg, state):
  model = state["model"]
  weights, kv_per_token = decode_step_weight_bytes(model.params), _kv_bytes_per_token(model)
  rows = {}
  for batch in sorted(set(cfg.decode_batches) | set(cfg.verify_batches)):
    runs = {}
    if batch in cfg.decode_batches:
      runs["decode"] = _step_runner(cfg, model, model.params, batch, 1)
    if batch in cfg.verify_batches:
      runs["verify"] = _step_runner(cfg, model, model.params, batch, cfg.verify_q_len)
    seconds = _time_steps(cfg, runs)
    row = {f"{name}_step_s": s for name, s in seconds.items()}
    if "decode" in seconds:
      row.update(step_bandwidth(weights, kv_per_token, cfg.step_context, batch,
                                seconds["decode"], cfg.peak_bandwidth))
    if len(seconds) == 2:
      row["verify_over_decode"] = seconds["verify"] / seconds["decode"]
    rows[str(batch)] = row
    logging.info("steps batch %d: %s", batch, row)
  return rows


def quant_section(cfg, state):
  model = state["model"]
  variants = {"bf16": model.params}
  for scheme in cfg.weight_schemes:
    variants[scheme] = jax.block_until_ready(quantize_params(model.params, model.config, scheme))
  rows = {name: dict(decode_step_weight_bytes=decode_step_weight_bytes(params))
          for name, params in variants.items()}
  for batch in cfg.quant_batches:
    seconds = _time_steps(cfg, {name: _step_runner(cfg, model, params, batch, 1)
                                for name, params in variants.items()})
    for name, s in seconds.items():
      rows[name][f"batch{batch}_step_s"] = s
      rows[name][f"batch{batch}_tokens_per_s"] = batch / s
    logging.info("quant batch %d: %s", batch,
                 {n: f"{batch / s:.1f} tok/s" for n, s in seconds.items()})
  return rows


def _prefill_then_decode(model, backend, tokens, q_lens, page_size):
  """Rows [B, T] prefilled from position 0, then one decode step of each row's argmax
  -> (prefill logits [B, V], decode logits [B, V]) as host arrays."""
  rows, width = tokens.shape
  pages = -(-(width + 1) // page_size)
  cache = create_paged_cache(model.config, None, rows, 1 + rows * pages, page_size, model.dtype)
  tables = 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
  batch = make_step_batch(tokens, np.zeros(rows), q_lens, tables)
  cache, first, _ = steps.prefill(model.params, cache, batch, config=model.config,
                                  backend=backend)
  nxt = jnp.argmax(first, -1).astype(jnp.int32)[:, None]
  batch = make_step_batch(nxt, np.asarray(q_lens), (np.asarray(q_lens) > 0), tables)
  _, second, _ = steps.prefill(model.params, cache, batch, config=model.config,
                               backend=backend)
  return np.asarray(first.astype(jnp.float32)), np.asarray(second.astype(jnp.float32))


def invariance_section(cfg, state):
  """Row 0 (a full-width prompt) among padding rows, among mixed prompts, and alone."""
  model = state["model"]
  rng = np.random.default_rng(cfg.seed + 1)
  rows, width = cfg.invariance_batch, cfg.invariance_prompt_len
  mixed = rng.integers(3, model.config.vocab_size, (rows, width)).astype(np.int32)
  mixed_lens = rng.integers(1, width + 1, rows)
  mixed_lens[0] = width
  padded, padded_lens = np.zeros_like(mixed), np.zeros_like(mixed_lens)
  padded[0], padded_lens[0] = mixed[0], width
  out = {}
  for backend in cfg.invariance_backends:
    runs = {name: _prefill_then_decode(model, backend, tokens, lens, cfg.page_size)
            for name, tokens, lens in (("mixed", mixed, mixed_lens),
                                       ("padded", padded, padded_lens),
                                       ("alone", mixed[:1], mixed_lens[:1]))}
    row = {}
    for other in ("padded", "alone"):
      for phase, index in (("prefill", 0), ("decode", 1)):
        a, b = runs["mixed"][index][0], runs[other][index][0]
        row[f"{phase}_mixed_equals_{other}"] = bool(np.array_equal(a, b))
        row[f"{phase}_max_abs_diff_vs_{other}"] = float(np.max(np.abs(a - b)))
    out[backend] = row
    logging.info("invariance %s: %s", backend, row)
  return out


def engine_section(cfg, state):
  """cfg.engine_runs in order, each after a warm-up pass of the identical workload (cli_bench's
  rule: shorter outputs leave context buckets to compile inside the timed run); a run is
  skipped once less than cfg.engine_run_estimate_s of the budget is left."""
  model = state["model"]
  out = {}
  for input_len, output_len, concurrency in cfg.engine_runs:
    name = f"{input_len}/{output_len}@{concurrency}"
    left = state["deadline"] - time.perf_counter()
    if left < cfg.engine_run_estimate_s:
      out[name] = dict(skipped=f"{left:.0f} s of the budget left, estimate "
                       f"{cfg.engine_run_estimate_s:.0f} s")
      continue
    sessions = bench_workloads.make_workload(
        "random", vocab_size=model.config.vocab_size, num_requests=concurrency,
        input_len=input_len, output_len=output_len, range_ratio=cfg.range_ratio, seed=cfg.seed)
    totals = [len(s.turns[0]) + s.max_new_tokens for s in sessions]
    engine = kvjax.Engine(
        model, backend=cfg.backend, page_size=cfg.page_size, max_num_seqs=concurrency,
        num_pages=min(1 + sum(-(-t // cfg.page_size) for t in totals), cfg.engine_max_pages),
        max_num_batched_tokens=cfg.max_num_batched_tokens, prefix_cache=False,
        max_model_len=min(next_pow2(max(totals)), model.config.max_position_embeddings),
        num_scheduler_steps=cfg.num_scheduler_steps)
    start = time.perf_counter()
    cli_bench.run_workload(engine, sessions)
    # The first step after an idle engine compiles once more (seen on the CPU): a
    # prefill-only pass of the same prompts takes that compile out of the timed run.
    cli_bench.run_workload(engine, [bench_workloads.Session(s.turns, 2) for s in sessions])
    warmup_s = time.perf_counter() - start
    summary = cli_bench.run_workload(engine, sessions)
    outputs = summary.pop("outputs")
    out[name] = dict(
        warmup_s=warmup_s, requested_output_tokens=sum(s.max_new_tokens for s in sessions),
        **{k: summary[k] for k in (
            "num_requests", "wall_s", "tokens_per_s", "request_throughput",
            "num_generated_tokens", "ttft", "tpot", "itl", "e2e_latency", "kv_utilization",
            "num_preemptions")})
    if "engine_vs_generate" not in state:  # greedy: the engine vs batch-1 generate
      checked = [(outputs[i][0], min(cfg.equality_tokens, sessions[i].max_new_tokens))
                 for i in range(min(cfg.equality_requests, len(sessions)))]
      state["engine_vs_generate"] = [dict(tokens=n, common_prefix=_common_prefix(
          ids[:n], kvjax.generate(model, sessions[i].turns, n, backend=cfg.backend,
                                  page_size=cfg.page_size).tokens[0]))
          for i, (ids, n) in enumerate(checked)]
      out[name]["engine_vs_generate"] = state["engine_vs_generate"]
    logging.info("engine %s: %.0f tok/s, TTFT median %.3f s, TPOT median %.4f s", name,
                 summary["tokens_per_s"], summary["ttft"]["median"], summary["tpot"]["median"])
    del engine
  return out


def _common_prefix(a, b) -> int:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def hf_section(cfg, state):
  model = state["model"]
  input_len, output_len, _ = cfg.engine_runs[0]  # the engine's first requests, same seed
  sessions = bench_workloads.make_workload(
      "random", vocab_size=model.config.vocab_size, num_requests=cfg.hf_batch,
      input_len=input_len, output_len=output_len, range_ratio=cfg.range_ratio, seed=cfg.seed)
  hf = to_hf_on_device(model)
  out = {}
  for batch in sorted({1, cfg.hf_batch}):
    prompts = [s.turns[0] for s in sessions[:batch]]
    for mode in cfg.hf_modes:
      key = f"{mode}@{batch}"
      try:
        timed = common.interleaved({key: lambda: hf_generate(
            hf, prompts, cfg.hf_new_tokens, mode)}, 1)
      except Exception as e:  # pylint: disable=broad-except
        out[key] = dict(error=f"{type(e).__name__}: {e}"[:2000])
        logging.warning("hf %s failed: %s", key, out[key]["error"])
        continue
      seconds = timed.seconds[key][0]
      out[key] = dict(seconds=seconds, first_seconds=timed.first_seconds[key],
                      tokens_per_s=batch * cfg.hf_new_tokens / seconds)
      logging.info("hf %s: %.1f tok/s", key, out[key]["tokens_per_s"])
  import torch  # pylint: disable=g-import-not-at-top
  del hf  # torch's caching allocator keeps freed blocks: hand them back before the engine's pool
  if torch.cuda.is_available():
    torch.cuda.empty_cache()
  return out


SECTIONS = dict(init=init_section, decode=decode_section, steps=steps_section,
                quant=quant_section, invariance=invariance_section, engine=engine_section,
                hf=hf_section)


def run_sections(cfg, report: dict, write) -> None:
  """Every section of cfg.sections in turn into report[name], its status into
  report["status"]; skipped once fewer seconds than its estimate remain."""
  start = time.perf_counter()
  state = dict(deadline=start + cfg.time_budget_s)
  for name in cfg.sections:
    left = cfg.time_budget_s - (time.perf_counter() - start)
    if left < cfg.section_estimates_s[name]:
      report["status"][name] = (f"skipped: {left:.0f} s of the budget left, estimate "
                                f"{cfg.section_estimates_s[name]:.0f} s")
      continue
    logging.info("section %s (%.0f s of the budget left)", name, left)
    began = time.perf_counter()
    try:
      report[name] = SECTIONS[name](cfg, state)
      report["status"][name] = "ok"
    except Exception as e:  # pylint: disable=broad-except
      report["status"][name] = "error: " + "".join(
          traceback.format_exception_only(type(e), e)).strip()[:2000]
      logging.error("section %s failed:\n%s", name, traceback.format_exc())
    report["section_seconds"][name] = time.perf_counter() - began
    if "engine_vs_generate" in state:
      report["engine_vs_generate"] = state["engine_vs_generate"]
    write()


# -- claims, goals, plot ----------------------------------------------------------


def _get(report: dict, *keys):
  """report[k0][k1]... or None where any level is missing."""
  for key in keys:
    if not isinstance(report, dict) or key not in report:
      return None
    report = report[key]
  return report


def _best_hf(report: dict, batch: int):
  """(mode, tokens/s) of the fastest HF mode at `batch`, or None."""
  rows = [(key.split("@")[0], row["tokens_per_s"]) for key, row in (report.get("hf") or {}).items()
          if key.endswith(f"@{batch}") and "tokens_per_s" in row]
  return max(rows, key=lambda r: r[1]) if rows else None


def claims(cfg, report: dict) -> list:
  """Claim rows (C9, C12, C14) from whatever sections finished."""
  model = _get(report, "init", "model")
  rows = []
  for batch in cfg.verify_batches:
    ratio = _get(report, "steps", str(batch), "verify_over_decode")
    if ratio is not None:
      rows.append(("C9", f"verify q_len {cfg.verify_q_len} / decode step, batch {batch}, "
                   f"ctx {cfg.step_context} ({model})", "~1x", ratio))
  for batch in cfg.quant_batches:
    bf16 = _get(report, "quant", "bf16", f"batch{batch}_tokens_per_s")
    for scheme in cfg.weight_schemes:
      ours = _get(report, "quant", scheme, f"batch{batch}_tokens_per_s")
      if bf16 and ours:
        rows.append(("C12", f"{scheme} / bf16 decode tokens/s, batch {batch} ({model})",
                     "~4" if scheme.startswith("int4") else "~2", ours / bf16))
  one, ten = _get(report, "steps", "1", "decode_step_s"), _get(report, "steps", "10",
                                                                "decode_step_s")
  if one and ten:
    rows.append(("C14", f"decode step batch 10 / batch 1, ctx {cfg.step_context} ({model})",
                 "~1x", ten / one))
  return common.claim_rows(rows)


def goals(cfg, report: dict) -> list:
  """The issue's goals, each (what, target, ours, met) where measured."""
  rows = []
  for context in cfg.decode_contexts:
    util = _get(report, "decode", str(context), "bandwidth_utilization")
    if util is not None:
      rows.append((f"batch-1 decode bandwidth utilization, ctx {context}", ">= 0.80", util,
                   util >= 0.8))
  engine = _get(report, "engine", "1000/1000@256", "tokens_per_s")
  if engine is not None:
    rows.append(("engine tok/s 1000/1000 @256 (bf16)", ">= 12000", engine, engine >= 12000))
  hf = _best_hf(report, cfg.hf_batch)
  first = next((k for k, r in (report.get("engine") or {}).items() if "tokens_per_s" in r), None)
  if hf and first:
    ratio = report["engine"][first]["tokens_per_s"] / hf[1]
    rows.append((f"engine {first} / HF {hf[0]} batch {cfg.hf_batch} tok/s", ">= 10", ratio,
                 ratio >= 10))
  for batch in cfg.verify_batches:
    ratio = _get(report, "steps", str(batch), "verify_over_decode")
    if ratio is not None:
      rows.append((f"verify / decode step, batch {batch}", "<= 1.15", ratio, ratio <= 1.15))
  bf16, int4 = (_get(report, "quant", name, "batch1_tokens_per_s") for name in ("bf16",
                                                                                "int4-g128"))
  if bf16 and int4:
    rows.append(("int4-g128 / bf16 decode tok/s, batch 1", ">= 2.5", int4 / bf16,
                 int4 / bf16 >= 2.5))
  for backend, row in (report.get("invariance") or {}).items():
    equal = row["prefill_mixed_equals_padded"] and row["decode_mixed_equals_padded"]
    rows.append((f"batch-invariant logits ({backend}, batch {cfg.invariance_batch})",
                 "bitwise", equal, equal))
  return [dict(zip(("goal", "target", "ours", "met"), row)) for row in rows]


def _plot(report: dict, path: str) -> None:
  with common.figure(path, 1, 3, figsize=(15, 4)) as (_, axes):
    decode = report.get("decode") or {}
    axes[0].bar(list(decode), [r["bandwidth_utilization"] for r in decode.values()])
    axes[0].axhline(0.8, ls="--", c="k")
    axes[0].set(title="batch-1 decode: model bandwidth utilization", xlabel="context")
    step_rows = report.get("steps") or {}
    for name in ("decode", "verify"):
      points = [(int(b), r[f"{name}_step_s"] * 1e3) for b, r in step_rows.items()
                if f"{name}_step_s" in r]
      if points:
        axes[1].plot(*zip(*points), "o-", label=name)
    for name, r in (report.get("quant") or {}).items():
      points = [(int(k[len("batch"):-len("_step_s")]), s * 1e3) for k, s in r.items()
                if k.endswith("_step_s")]
      axes[1].plot(*zip(*points), "s:", label=f"{name} weights")
    axes[1].set(title="step time (ms)", xlabel="batch", xscale="log")
    axes[1].legend()
    bars = {f"kvjax {k}": r["tokens_per_s"] for k, r in (report.get("engine") or {}).items()
            if "tokens_per_s" in r}
    bars.update({f"HF {k}": r["tokens_per_s"] for k, r in (report.get("hf") or {}).items()
                 if "tokens_per_s" in r})
    axes[2].barh(list(bars), list(bars.values()))
    axes[2].set(title="output tokens/s", xscale="log")


def run(cfg) -> dict:
  """Every section, then claims and goals printed; writes <out_dir>/<name>.json and .png."""
  unknown = set(cfg.sections) - set(SECTIONS)
  if unknown:
    raise ValueError(f"unknown sections {sorted(unknown)}; use some of {sorted(SECTIONS)}")
  report = dict(config=cfg.to_dict(), device=common.device_label(),
                device_info=common.describe_device(), status={}, section_seconds={})
  path = f"{cfg.out_dir}/{cfg.name}.json"
  start = time.perf_counter()
  run_sections(cfg, report, lambda: common.write_json(path, report))
  report["seconds"] = time.perf_counter() - start
  report["claims"], report["goals"] = claims(cfg, report), goals(cfg, report)
  print()
  common.print_claims(report["claims"], "{claim:5s} {what:70s} {seed:>5s} {ours:>8s}", "{:.3f}")
  print()
  for row in report["goals"]:
    print(f"{row['goal']:58s} {row['target']:>9s} {row['ours']!s:>22.22s} "
          f"{'met' if row['met'] else 'NOT met'}")
  print("status:", report["status"])
  common.write_results(cfg.out_dir, cfg.name, report, plot=functools.partial(_plot, report))
  return report


def main(argv):
  del argv
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined here, not at import: the tests import this module beside other launchers,
  # and absl allows one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/gpu_scale.py", "experiment config", lock_config=True)
  app.run(main)
