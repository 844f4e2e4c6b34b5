"""Claims C6, C12, C16 on a real model: what each KV and weight variant costs in quality.

For every variant of the config (configs/variant_quality.py says the names) on
SmolLM2-135M-Instruct (or Gemma 3 270M, the config's "gemma3"): teacher-forced perplexity of the stdlib text through the
paged cache the variant uses (prefill chunks + decode steps, kvjax/eval/perplexity.py)
and its delta against "float", KV bytes per token, HumanEval pass@1 (greedy, a
subset, kvjax/eval/humaneval.py) and needle accuracy by context length
(kvjax/eval/needle.py), and decode speed: every variant's engine runs the same batch
in interleaved rounds, tokens/s = batch / median time per output token.  Sinks + window
(the sinks_window attention variant as a kv_dtype, kvjax/eval/variant.py; "streaming"
is its 4 + 1020) sits beside the plain window of the same size (4 + 252 vs 256,
4 + 1020 vs 1024): what the sinks buy back.  Prints the goals (int8 KV within 0.5% of
float perplexity, KIVI int4 within 3%, int8 weights within 1%) beside ours, writes
results/<name>.json + .png.
"""
import dataclasses
import functools
import time

from absl import app
import jax
from ml_collections import config_flags
import numpy as np

from experiments import common
import kvjax
from kvjax.eval import humaneval, needle, perplexity, text_set, variant
from kvjax.weights.quantize import quantize_params

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/variant_quality.py", "experiment config", lock_config=True)

AWQ = "awq-"  # a weight variant "weights-awq-<scheme>": AWQ-calibrated <scheme>
GOALS = {"kv-int8": 0.5, "kv-int4": 3.0, "weights-int8": 1.0}  # % perplexity over float


def _row(cfg, name: str, model, ids) -> dict:
  opts = variant.parse_variant(name)
  row = dict(variant=name, **opts)
  row["perplexity"] = perplexity.perplexity(
      model, ids, context=cfg.ppl_context, chunk=cfg.ppl_chunk,
      decode_tokens=cfg.ppl_decode_tokens, page_size=cfg.page_size, kv_dtype=opts["kv_dtype"],
      sliding_window=opts["sliding_window"], batch_size=cfg.ppl_batch_size,
      max_tokens=cfg.ppl_tokens)
  row["kv_bytes_per_token"] = row["perplexity"].pop("kv_bytes_per_token")
  served = variant.with_window(model, opts["sliding_window"])
  if name in cfg.humaneval_variants:
    problems = humaneval.load_problems(cfg.humaneval_limit)
    engine = kvjax.Engine(served, page_size=cfg.page_size, kv_dtype=opts["kv_dtype"],
                          max_num_seqs=cfg.max_num_seqs, max_model_len=1024)
    row["humaneval"] = humaneval.evaluate(engine, model.tokenizer, problems,
                                          max_new_tokens=cfg.humaneval_new_tokens,
                                          timeout_s=cfg.humaneval_timeout_s,
                                          mode=cfg.humaneval_mode)
  if name in cfg.needle_variants:
    engine = kvjax.Engine(served, page_size=cfg.page_size, kv_dtype=opts["kv_dtype"],
                          max_num_seqs=cfg.max_num_seqs,
                          max_model_len=max(cfg.needle_lengths) + 16)
    row["needle"] = needle.needle_accuracy(engine, model.tokenizer, cfg.needle_lengths,
                                           cfg.needle_depths, label=name, mode=cfg.needle_mode)
  return row


def _weights(cfg, weight_dtype, models: dict, ids) -> kvjax.Model:
  """The model of one weight variant: a load with its weight_dtype, or for
  "awq-<scheme>" the float model (loaded first) quantized with AWQ, calibrated on
  cfg.awq_calibration_tokens of the text past the part perplexity scores."""
  if not (weight_dtype or "").startswith(AWQ):
    return kvjax.load_checkpoint(cfg.model, weight_dtype=weight_dtype)
  if None not in models or len(ids) < cfg.ppl_tokens + cfg.awq_calibration_tokens:
    raise ValueError(f"weights-{weight_dtype} needs 'float' earlier in variants and "
                     f"{cfg.ppl_tokens + cfg.awq_calibration_tokens} text tokens")
  base = models[None]
  calibration = np.asarray(ids[cfg.ppl_tokens:cfg.ppl_tokens + cfg.awq_calibration_tokens],
                           np.int32)[None]
  params = quantize_params(base.params, base.config, weight_dtype[len(AWQ):],
                           calibration_tokens=calibration)
  return dataclasses.replace(base, params=params)


def _speed(cfg, models: dict, ids) -> dict:
  """name -> decode tokens/s of cfg.speed_variants at batch cfg.speed_batch: every
  variant's engine generates from the same text prompts in interleaved rounds (the
  machine's drift hits them alike); tokens/s = batch / the median round's mean time per
  output token, so prefill is not in it."""
  if not cfg.speed_variants:
    return {}
  n = cfg.speed_prompt_len
  prompts = [list(ids[i * n:(i + 1) * n]) for i in range(cfg.speed_batch)]
  runs = {}
  for name in cfg.speed_variants:
    opts = variant.parse_variant(name)
    engine = kvjax.Engine(variant.with_window(models[opts["weight_dtype"]],
                                              opts["sliding_window"]),
                          page_size=cfg.page_size, kv_dtype=opts["kv_dtype"],
                          max_num_seqs=cfg.speed_batch,
                          max_model_len=n + cfg.speed_new_tokens + cfg.page_size)
    runs[name] = functools.partial(engine.generate, prompts, cfg.speed_new_tokens)
  print(f"speed: {len(runs)} engines, batch {cfg.speed_batch}, {cfg.speed_repeats} "
        "interleaved rounds after a warm-up each", flush=True)
  timings = common.interleaved(runs, cfg.speed_repeats)
  out = {}
  for name, results in timings.results.items():
    tpots = [r.stats["tpot_s"] for r in results]
    out[name] = dict(decode_tokens_per_s=cfg.speed_batch / common.median(tpots),
                     tpot_s=tpots, batch=cfg.speed_batch, prompt_len=n,
                     new_tokens=cfg.speed_new_tokens)
  return out


def _claims(rows: dict, cfg) -> list:
  base = rows["float"]["perplexity"]["nats_per_token"]
  ctx = f"{cfg.model_label}, {rows['float']['perplexity']['tokens']}-token stdlib text"
  out = []

  def delta(name):
    return 100 * (rows[name]["perplexity"]["perplexity"] / rows["float"]["perplexity"][
        "perplexity"] - 1)

  for name, claim, seed in (("kv-int8", "C6", "goal <= 0.5%"), ("kv-int4", "C6", "goal <= 3%"),
                            ("kv-bf16", "C6", "-"), ("weights-int8", "C12", "goal <= 1%"),
                            ("weights-int4", "C12", "-"), ("weights-int4-g64", "C12", "-"),
                            ("weights-int4-g128", "C12", "-"),
                            ("weights-awq-int4-g128", "C12", "-"),
                            ("window-256", "C16", "-"), ("window-1024", "C16", "-"),
                            ("sinks4-window252", "C16", "-"), ("sinks4-window1020", "C16", "-")):
    if name in rows:
      out.append(dict(claim=claim, what=f"{ctx}: perplexity {name} vs float (paged, "
                      f"float {base:.4f} nats/token)", seed=seed, ours=f"{delta(name):+.2f}%"))
  for name, seed in (("kv-int8", "1/4 (int8 / fp32)"), ("kv-int4", "1/8 (int4 / fp32)")):
    if name in rows:
      out.append(dict(claim="C6", what=f"{cfg.model_label}: KV bytes/token {name} / fp32 (scales "
                      "included)", seed=seed,
                      ours=round(rows[name]["kv_bytes_per_token"]
                                 / rows["float"]["kv_bytes_per_token"], 4)))
  he = {n: r["humaneval"] for n, r in rows.items() if "humaneval" in r}
  if he:
    out.append(dict(claim="C12", what=f"{cfg.model_label} HumanEval pass@1 (greedy, "
                    f"{cfg.humaneval_mode}, first {cfg.humaneval_limit}): " + ", ".join(he), seed="-",
                    ours=" / ".join(f"{h['passed']}/{h['count']}" for h in he.values())))
  for name in ("weights-int8", "weights-int4", "weights-int4-g128", "weights-awq-int4-g128",
               "kv-int8", "kv-int4"):
    if "speed" in rows.get(name, {}) and "speed" in rows["float"]:
      claim, seed = ("C12", "faster") if name.startswith("weights") else ("C6", "-")
      out.append(dict(claim=claim, what=f"{cfg.model_label} decode tokens/s at batch "
                      f"{cfg.speed_batch}, {name} / float (interleaved rounds)", seed=seed,
                      ours=round(rows[name]["speed"]["decode_tokens_per_s"]
                                 / rows["float"]["speed"]["decode_tokens_per_s"], 3)))
  nd = {n: r["needle"] for n, r in rows.items() if "needle" in r}
  for n, r in nd.items():
    out.append(dict(claim="C16", what=f"{cfg.model_label} needle accuracy, {n}, context "
                    + "/".join(r["by_length"]) + f" (depths {list(cfg.needle_depths)})",
                    seed="a window loses far context" if n != "float" else "-",
                    ours=" / ".join(f"{v:.2f}" for v in r["by_length"].values())))
  return out


def _plot(rows: dict, path: str) -> None:
  with common.figure(path, 1, 3, figsize=(17, 4.5)) as (_, (left, middle, right)):
    names = list(rows)
    base = rows["float"]["perplexity"]["perplexity"]
    deltas = [100 * (rows[n]["perplexity"]["perplexity"] / base - 1) for n in names]
    left.bar(range(len(names)), deltas)
    left.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    for n, goal in GOALS.items():
      if n in names:
        left.plot([names.index(n) - 0.4, names.index(n) + 0.4], [goal, goal], "r--")
    left.set(ylabel="perplexity vs float (%)", title="perplexity through the paged cache "
             "(red: goal)")
    fast = [n for n in names if "speed" in rows[n]]
    middle.bar(range(len(fast)), [rows[n]["speed"]["decode_tokens_per_s"] for n in fast])
    middle.set_xticks(range(len(fast)), fast, rotation=45, ha="right", fontsize=8)
    middle.set(ylabel="decode tokens/s", title="decode speed, batch "
               f"{rows[fast[0]]['speed']['batch'] if fast else '-'} (interleaved rounds)")
    for n, r in rows.items():
      if "needle" in r:
        lengths = list(r["needle"]["by_length"])
        right.plot([int(x) for x in lengths], list(r["needle"]["by_length"].values()),
                   marker="o", label=n)
    right.set(xlabel="context (tokens)", ylabel="needle accuracy", ylim=(-0.05, 1.05),
              title="needle retrieval (C16)")
    right.legend()


def main(_):
  cfg = _CONFIG.value
  start = time.perf_counter()
  print("goals: int8 KV perplexity within 0.5% of float, KIVI int4 within 3%, int8 weights "
        "within 1% (C6, C12); C16: where a window starts to lose far context", flush=True)
  models, rows, ids = {}, {}, None
  for name in cfg.variants:
    weight_dtype = variant.parse_variant(name)["weight_dtype"]
    if weight_dtype not in models:  # each weight variant loaded once, kept for _speed
      models[weight_dtype] = _weights(cfg, weight_dtype, models, ids)
      ids = text_set.text_ids(models[weight_dtype].tokenizer)
    rows[name] = _row(cfg, name, models[weight_dtype], ids)
    jax.clear_caches()  # each variant compiles its own programs: past ~20 variants'
    # executables the process runs out of memory maps (vm.max_map_count) and LLVM fails
    ppl = rows[name]["perplexity"]
    base = rows["float"]["perplexity"]["perplexity"]
    goal = GOALS.get(name)
    print(f"{name:18s} ppl {ppl['perplexity']:.4f} ({100 * (ppl['perplexity'] / base - 1):+.2f}%"
          f"{'' if goal is None else f', goal <= {goal}%'}) bits/byte "
          f"{ppl['bits_per_byte']:.4f} KV B/token {rows[name]['kv_bytes_per_token']:.0f}"
          + (f" pass@1 {rows[name]['humaneval']['pass_at_1']:.2f}" if "humaneval" in
             rows[name] else "")
          + (f" needle {rows[name]['needle']['by_length']}" if "needle" in rows[name] else ""),
          flush=True)
  for name, speed in _speed(cfg, models, ids).items():
    rows[name]["speed"] = speed
    print(f"{name:18s} decode {speed['decode_tokens_per_s']:.1f} tokens/s", flush=True)
  results = dict(config=cfg.to_dict(), model=cfg.model, device=common.device_label(),
                 text=text_set.load_text.__doc__.split("\n")[0], goals_percent=GOALS,
                 seconds=time.perf_counter() - start, rows=rows, claims=_claims(rows, cfg))
  for claim in results["claims"]:
    print(f"{claim['claim']} {claim['what']}: seed {claim['seed']} | ours {claim['ours']}")
  common.write_results(cfg.out_dir, cfg.name, results, plot=lambda p: _plot(rows, p))


if __name__ == "__main__":
  app.run(main)
