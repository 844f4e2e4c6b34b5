"""Claims C4-C6: every memory figure of the seeds beside kvjax's ledger.

Prints one row per seed figure (claim, what, seed value, ours, unit, match),
writes results/<name>.json and a PNG of one request's KV GiB against context.
Units follow kvjax.parallel.ledger: binary throughout, a seed's "GB" of cache or card
read as GiB; the seeds' weight sizes are nominal (name-size x bytes per
parameter, in the unit the seed wrote), shown next to the size counted from the
config.  Match: ours rounded to the seed's decimals equals the seed (fractions
exactly); a measured or "about" (~, 约) figure within `rel_tol`; ">=" and "<=" rows check the
seed's bound; "info" rows show other baselines and assert nothing.
"""
import fractions
import functools
import os

from absl import app
from ml_collections import config_flags

from experiments import common
from kvjax.model.presets import get_preset
from kvjax.parallel import ledger
from kvjax.parallel.ledger import GIB, KIB

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/memory_ledger.py", "experiment config", lock_config=True)

GB = 10**9  # decimal, only where the seed's nominal weight figure is decimal.


def _row(claim, what, seed, ours, unit, rule="exact", rel_tol=0.0):
  """One comparison; `seed` is the seed's figure as written: '13', '0.5', '1/32'."""
  seed_value = float(fractions.Fraction(seed))
  if rule == "exact":
    decimals = len(seed.split(".")[1]) if "." in seed else 0
    match = (abs(ours - seed_value) <= 1e-12 if "/" in seed
             else round(ours, decimals) == seed_value)
  elif rule == "approx":
    match = abs(ours / seed_value - 1) <= rel_tol
  elif rule == ">=":  # the seed gives a bound ("500 多 GiB", "不到三分之一").
    match = ours >= seed_value
  elif rule == "<=":
    match = ours <= seed_value
  else:  # "info"
    match = None
  return dict(claim=claim, what=what, seed=seed, ours=ours, unit=unit, rule=rule,
              match=match)


def _c4_rows():
  mha7, gqa8, gqa70 = get_preset("llama2-7b"), get_preset("llama3-8b"), get_preset("llama3-70b")
  req = lambda cfg, n, dtype="fp16": ledger.kv_bytes_per_request(cfg, n, dtype) / GIB
  rows = [
      _row("C4", "7B MHA values/token (2x32x32x128)", "262144",
           ledger.kv_values_per_token(mha7), "values"),
      _row("C4", "7B MHA KV/token", "512", ledger.kv_bytes_per_token(mha7, "fp16") / KIB,
           "KiB"),
      _row("C4", "7B MHA one request at 128K", "64", req(mha7, 131072), "GiB"),
      _row("C4", "7B weights, nominal 7e9 x 2 B", "13", 7e9 * 2 / GIB, "GiB"),
      _row("C4", "7B weights, counted (llama2-7b)", "13",
           ledger.weight_bytes(mha7, "fp16") / GIB, "GiB", "approx", rel_tol=0.05),
      _row("C4", "7B KV at 128K / nominal weights (~5x)", "5",
           req(mha7, 131072) / (7e9 * 2 / GIB), "x"),
      _row("C4", "7B KV at 128K share of an 80 GB card", "0.8", req(mha7, 131072) / 80,
           "fraction"),
      _row("C4", "7B batch 8 at 128K (500+ GiB)", "500", 8 * req(mha7, 131072), "GiB", ">="),
      _row("C4", "8B GQA KV/token (2x32x8x128x2)", "131072",
           ledger.kv_bytes_per_token(gqa8, "fp16"), "bytes"),
      _row("C4", "8B GQA KV/token", "128", ledger.kv_bytes_per_token(gqa8, "fp16") / KIB,
           "KiB"),
  ]
  for n, seed in ((4096, "0.5"), (8192, "1"), (32768, "4"), (131072, "16")):
    rows.append(_row("C4", f"8B one request at {n // 1024}K", seed, req(gqa8, n), "GiB"))
  rows += [
      _row("C4", "8B weights, nominal 8e9 x 2 B", "16", 8e9 * 2 / GB, "GB"),
      _row("C4", "8B weights, counted (llama3-8b)", "16",
           ledger.weight_bytes(gqa8, "fp16") / GB, "GB", "approx", rel_tol=0.05),
      _row("C4", "70B GQA KV/token (2x80x8x128x2)", "327680",
           ledger.kv_bytes_per_token(gqa70, "fp16"), "bytes"),
      _row("C4", "70B GQA KV/token", "320", ledger.kv_bytes_per_token(gqa70, "fp16") / KIB,
           "KiB"),
  ]
  for n, seed in ((8192, "2.5"), (32768, "10"), (131072, "40")):
    rows.append(_row("C4", f"70B one request at {n // 1024}K", seed, req(gqa70, n), "GiB"))
  int4_counted = ledger.weight_bytes(gqa70, "int4")
  rows += [
      _row("C4", "70B fp16 weights, nominal 70e9 x 2 B", "140", 70e9 * 2 / GB, "GB"),
      _row("C4", "70B fp16 weights, counted (llama3-70b)", "140",
           ledger.weight_bytes(gqa70, "fp16") / GB, "GB", "approx", rel_tol=0.05),
      _row("C4", "70B int4 weights, nominal 70e9 x 0.5 B", "35", 70e9 * 0.5 / GB, "GB"),
      _row("C4", "70B int4 weights, counted (llama3-70b)", "35", int4_counted / GB, "GB",
           "approx", rel_tol=0.05),
      _row("C4", "70B 128K cache > int4 weights (counted)", "1",
           int(ledger.kv_bytes_per_request(gqa70, 131072, "fp16") > int4_counted), "bool"),
      _row("C4", "70B 128K cache / fp16 weights (< 1/3)", "1/3",
           ledger.kv_bytes_per_request(gqa70, 131072, "fp16")
           / ledger.weight_bytes(gqa70, "fp16"), "x", "<="),
      _row("C4", "Qwen3.5-9B KV/token (8 full-attn layers; measured)", "32.3",
           ledger.kv_bytes_per_token(get_preset("qwen3.5-9b"), "bf16") / KIB, "KiB",
           "approx", rel_tol=0.02),
  ]
  return rows


def _c5_rows(config):
  gqa8 = get_preset("llama3-8b")
  budget = dict(gpu_gib=config.gpu_gib, reserve_gib=config.reserve_gib,
                weight_gib=config.seed_weight_gib, kv_dtype="fp16")
  at4k = ledger.plan(gqa8, 4096, **budget)
  at32k = ledger.plan(gqa8, 32768, **budget)
  size8k = ledger.plan(gqa8, 8192, batch=50, **budget)
  size4k = ledger.plan(gqa8, 4096, batch=50, **budget)
  return [
      _row("C5", "free for KV: 80 - 16 - 4", "60", at4k.free_kv_bytes / GIB, "GiB"),
      _row("C5", "max concurrency at 4K", "120", at4k.max_concurrency, "requests"),
      _row("C5", "max concurrency at 32K", "15", at32k.max_concurrency, "requests"),
      _row("C5", "4K -> 32K concurrency drop", "8",
           at4k.max_concurrency / at32k.max_concurrency, "x"),
      _row("C5", "sizing: 8K, 50 concurrent: 16 + 50 + 4", "70", size8k.total_bytes / GIB,
           "GiB"),
      _row("C5", "sizing: 4K, 50 concurrent: 16 + 25 + 4", "45", size4k.total_bytes / GIB,
           "GiB"),
  ]


def _c6_rows():
  mha7, gqa8, gqa70 = get_preset("llama2-7b"), get_preset("llama3-8b"), get_preset("llama3-70b")
  per_token = lambda cfg, dtype="fp16": ledger.kv_bytes_per_token(cfg, dtype)
  mha_of = lambda cfg: cfg.replace(num_kv_heads=cfg.num_heads)
  mqa7 = mha7.replace(num_kv_heads=1)
  # DeepSeek-V2 paper, Fig. 1(b): V2 caches its 576-value latent at ~6 bits per
  # element (FP8 + KV quantization) against DeepSeek 67B's bf16 GQA cache.
  v2, ds67 = get_preset("deepseek-v2"), get_preset("deepseek-llm-67b")
  mla_6bit = ledger.kv_values_per_token(v2) * 6 / 8
  mla_bf16 = per_token(v2, "bf16")
  # V2's own MHA counterpart: 128 heads of K 192 (nope 128 + rope 64) and V 128, bf16.
  v2_mha = 2 * v2.num_layers * v2.num_heads * (
      v2.qk_nope_head_dim + v2.qk_rope_head_dim + v2.v_head_dim)
  scales = lambda cfg, dtype: ledger.kv_scale_bytes_per_token(cfg, dtype)
  return [
      _row("C6", "MHA KV/token (2x32x32x128x2)", "524", per_token(mha7) / 1000, "kB"),
      _row("C6", "GQA KV/token (2x32x8x128x2)", "131", per_token(gqa8) / 1000, "kB"),
      _row("C6", "MQA KV/token (~16 KB, 8x below GQA)", "16", per_token(mqa7) / 1000, "kB"),
      _row("C6", "MHA baseline", "1", per_token(mha7) / per_token(mha7), "x"),
      _row("C6", "MQA vs MHA (7B, 1 of 32 kv heads)", "1/32", per_token(mqa7) / per_token(mha7),
           "x"),
      _row("C6", "GQA vs MHA (8B, 8 of 32 kv heads)", "1/4",
           per_token(gqa8) / per_token(mha_of(gqa8)), "x"),
      _row("C6", "GQA vs MHA (70B, 8 of 64 kv heads)", "1/8",
           per_token(gqa70) / per_token(mha_of(gqa70)), "x"),
      _row("C6", "MLA 6-bit vs DeepSeek 67B bf16: reduction", "0.933",
           1 - mla_6bit / per_token(ds67, "bf16"), "fraction"),
      _row("C6", "MLA 6-bit vs DeepSeek 67B bf16 (~1/15)", "15",
           per_token(ds67, "bf16") / mla_6bit, "x smaller"),
      _row("C6", "MLA bf16 vs DeepSeek 67B bf16 (other baseline)", "15",
           per_token(ds67, "bf16") / mla_bf16, "x smaller", "info"),
      _row("C6", "MLA bf16 vs V2's own MHA bf16 (other baseline)", "15",
           v2_mha / mla_bf16, "x smaller", "info"),
      _row("C6", "KV int8 vs fp16 (ideal)", "1/2", per_token(gqa8, "int8") / per_token(gqa8),
           "x"),
      _row("C6", "KV int4 vs fp16 (ideal)", "1/4", per_token(gqa8, "int4") / per_token(gqa8),
           "x"),
      _row("C6", "KV int8 + fp32 per-vector scales (real size)", "1/2",
           (per_token(gqa8, "int8") + scales(gqa8, "int8")) / per_token(gqa8), "x", "info"),
      _row("C6", "KV int4 + fp32 per-vector scales (real size)", "1/4",
           (per_token(gqa8, "int4") + scales(gqa8, "int4")) / per_token(gqa8), "x", "info"),
      _row("C6", "GQA (4x) then int8 (2x): 8B int8 vs 7B MHA fp16", "1/8",
           per_token(gqa8, "int8") / per_token(mha7), "x"),
  ]


def _plot(config, path):
  with common.figure(path, figsize=(7, 4.5), dpi=120) as (_, ax):
    _draw(config, ax)


def _draw(config, ax):
  contexts = [1 << k for k in config.plot_log2_contexts]
  for name in config.plot_presets:
    cfg = get_preset(name)
    ax.plot(contexts, [ledger.kv_bytes_per_request(cfg, n) / GIB for n in contexts],
            marker="o", label=f"{name} KV (bf16)")
  gqa70 = get_preset("llama3-70b")
  int4 = ledger.weight_bytes(gqa70, "int4") / GIB
  ax.axhline(int4, color="k", ls="--", label=f"llama3-70b int4 weights ({int4:.1f} GiB)")
  ax.axhline(config.gpu_gib, color="r", ls=":", label=f"{config.gpu_gib:g} GiB card")
  ax.set(xscale="log", yscale="log", xlabel="context tokens (one request)",
         ylabel="KV cache GiB",
         title="C4: one 128K request of the 70B caches more than its int4 weights")
  ax.set_xticks(contexts, [f"{n // 1024}K" for n in contexts])
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)


def main(argv):
  del argv
  config = _CONFIG.value
  rows = _c4_rows() + _c5_rows(config) + _c6_rows()
  print(f"{'claim':5} {'figure':55} {'seed':>8} {'ours':>12} {'unit':9} match")
  for r in rows:
    print(f"{r['claim']:5} {r['what']:55} {r['seed']:>8} {r['ours']:>12.6g} {r['unit']:9} "
          f"{ {True: 'yes', False: 'NO', None: '-'}[r['match']]} ({r['rule']})")
  # The C5 question with weights counted from the config instead of the seed's 16.
  counted = {n: ledger.plan(get_preset("llama3-8b"), n, kv_dtype="fp16",
                            gpu_gib=config.gpu_gib, reserve_gib=config.reserve_gib)
             for n in (4096, 32768)}
  print("C5 with llama3-8b weights counted ({:.2f} GiB): {} at 4K, {} at 32K".format(
      counted[4096].weight_bytes / GIB, counted[4096].max_concurrency,
      counted[32768].max_concurrency))
  png = os.path.join(config.out_dir, f"{config.name}.png")
  out = dict(claims=["C4", "C5", "C6"], rows=rows,
             all_seed_figures_match=all(r["match"] for r in rows if r["rule"] != "info"),
             c5_with_counted_weights={n: dict(weight_gib=p.weight_bytes / GIB,
                                              max_concurrency=p.max_concurrency)
                                      for n, p in counted.items()},
             units="binary (KiB/GiB); seed 'GB' of cache/card read as GiB; kB/GB rows decimal",
             plot=png)
  common.write_results(config.out_dir, config.name, out, plot=functools.partial(_plot, config),
                       indent=2)


if __name__ == "__main__":
  app.run(main)
