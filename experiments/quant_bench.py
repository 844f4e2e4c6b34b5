"""Claims C6 (KV int8 halves, int4 quarters) and C12 (4-bit weights: ~4x fewer bytes
per decode step, hence faster), measured on the default model.

KV cache, per kv_dtype (fp32 cache = reference): logit error and held-out
bits/byte with the whole window scored through the paged cache (`verify`, so
every query reads quantized pages), greedy agreement of `generate` over
`greedy_new_tokens` tokens, and bytes per cached token (pages + scales; int4's
per-slot residual reported apart).  Weights, per scheme (float32 = reference):
held-out bits/byte, weight bytes one decode step reads, and batch-1 decode
tokens/s with bf16 activations.  Prints the seed's value beside ours, writes
results/<name>.json and .png.
"""
import functools
import math
import os
import time

from absl import app
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
import kvjax
from kvjax.caches import create_paged_cache
from kvjax.model.config import ModelConfig
from kvjax.model.params import init_params
from kvjax.runtime.step_batch import make_step_batch
from kvjax.runtime.steps import verify
from kvjax.text.tokenizer import ByteTokenizer
from kvjax.training import code_corpus
from kvjax.training import corpus as corpus_lib
from kvjax.training.train import bits_per_byte
from kvjax.weights.quantize import decode_step_weight_bytes, quantize_params

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quant_bench.py", "experiment config", lock_config=True)


def _paged_rows(config, kv_dtype, inputs, page_size):
  """A fresh paged cache for inputs [B, T] and the StepBatch scoring them from position 0."""
  rows, length = inputs.shape
  pages = -(-length // page_size)
  cache = create_paged_cache(config, None if kv_dtype == "fp32" else kv_dtype, rows,
                             1 + rows * pages, page_size, jnp.float32)
  tables = 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
  return cache, make_step_batch(inputs, np.zeros(rows), np.full(rows, length), tables)


@functools.partial(jax.jit, static_argnames=("config", "kv_dtype", "page_size"))
def _cached_logits(params, inputs, *, config, kv_dtype, page_size):
  """inputs [B, T] scored in one step through a fresh paged cache -> logits [B, T, V]."""
  cache, batch = _paged_rows(config, kv_dtype, inputs, page_size)
  _, logits, _ = verify(params, cache, batch, config=config)
  return logits


def _kv_section(cfg, model, windows, prompts):
  rows = {}
  reference, ref_greedy = {}, None
  for kv_dtype in cfg.kv_dtypes:
    nats, count, sq_err, sq_ref, top1 = 0.0, 0, 0.0, 0.0, 0
    for i in range(0, len(windows), cfg.batch_size):
      w = jnp.asarray(windows[i:i + cfg.batch_size])
      logits = _cached_logits(model.params, w[:, :-1], config=model.config,
                              kv_dtype=kv_dtype, page_size=cfg.page_size)
      targets = w[:, 1:]
      logp = jax.nn.log_softmax(logits, -1)
      picked = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
      is_byte = targets < ByteTokenizer.num_bytes
      nats += float(jnp.sum(jnp.where(is_byte, picked, 0.0)))
      count += int(jnp.sum(is_byte))
      ref_logits = reference.setdefault(i, logits)  # the first kv_dtype is the reference
      sq_err += float(jnp.sum((logits - ref_logits) ** 2))
      sq_ref += float(jnp.sum(ref_logits ** 2))
      top1 += int(jnp.sum(jnp.argmax(logits, -1) == jnp.argmax(ref_logits, -1)))
    greedy = kvjax.generate(model, prompts, cfg.greedy_new_tokens, page_size=cfg.page_size,
                            kv_dtype=None if kv_dtype == "fp32" else kv_dtype).tokens
    ref_greedy = ref_greedy or greedy
    agree = [sum(a == b for a, b in zip(x, y)) / cfg.greedy_new_tokens
             for x, y in zip(greedy, ref_greedy)]
    first_diff = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                  for x, y in zip(greedy, ref_greedy)]
    cache, _ = _paged_rows(model.config, kv_dtype, np.zeros((1, 1024), np.int32),
                           cfg.page_size)
    leaves = jax.tree_util.tree_leaves(cache)
    residual = sum(x.nbytes for name, x in vars(cache).items() if name.endswith("residual"))
    capacity = cache.num_pages * cache.page_size
    per_token = (sum(x.nbytes for x in leaves) - residual) / capacity
    rows[kv_dtype] = dict(
        heldout_bits_per_byte=nats / count / math.log(2),
        logit_rel_l2=math.sqrt(sq_err / sq_ref), teacher_forced_top1_agreement=top1 / (
            windows.shape[0] * (windows.shape[1] - 1)),
        greedy_agreement=float(np.mean(agree)), greedy_first_divergence=first_diff,
        cache_bytes_per_token=per_token, residual_bytes_per_slot=residual)
    print(f"kv {kv_dtype:5s} bpb {rows[kv_dtype]['heldout_bits_per_byte']:.4f} "
          f"rel-l2 {rows[kv_dtype]['logit_rel_l2']:.2e} greedy {np.mean(agree):.3f} "
          f"B/token {per_token:.0f}", flush=True)
  return rows


def _tokens_per_s(cfg, config, params, prompt):
  """Decode tokens/s of one batch-1 generate with bf16 activations."""
  model = kvjax.Model(config, params, jnp.bfloat16)
  stats = kvjax.generate(model, [prompt], cfg.speed_new_tokens, page_size=cfg.page_size).stats
  return 1.0 / stats["tpot_s"]


def _weight_section(cfg, model, windows, calibration):
  f32 = model.params
  variants = {"fp32": f32, "bf16": jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), f32)}
  for scheme in cfg.weight_schemes:
    variants[scheme] = quantize_params(f32, model.config, scheme)
  for scheme in cfg.awq_schemes:
    variants[scheme + "+awq"] = quantize_params(f32, model.config, scheme,
                                                calibration_tokens=calibration)
  rows = {}
  for name, params in variants.items():
    rows[name] = dict(
        heldout_bits_per_byte=bits_per_byte(params, model.config, windows, cfg.batch_size),
        decode_step_weight_bytes=decode_step_weight_bytes(params))
    print(f"weights {name:15s} " + " ".join(f"{k} {v:.4g}" for k, v in rows[name].items()),
          flush=True)
  return rows


def _speed_section(cfg, model):
  """Decode tokens/s and weight bytes per step: bf16 weights vs each scheme.

  After one compiling run each, variants take turns for speed_repeats rounds and
  each keeps its best run (the compiling one included), so drift on a shared
  machine hits all alike.
  """
  if cfg.speed_preset:
    config = ModelConfig(**cfg.speed_preset.to_dict())
    bf16 = init_params(config, jax.random.PRNGKey(0), jnp.bfloat16)
  else:
    config = model.config
    bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), model.params)
  prompt = [int(t) for t in np.arange(3, 3 + cfg.greedy_prompt_len) % config.vocab_size]
  variants = {name: bf16 if name == "bf16" else quantize_params(bf16, config, name)
              for name in ("bf16",) + tuple(cfg.weight_schemes)}
  timed = common.interleaved({
      name: functools.partial(_tokens_per_s, cfg, config, params, prompt)
      for name, params in variants.items()}, cfg.speed_repeats)
  best = {name: max([timed.first_results[name]] + timed.results[name]) for name in variants}
  rows = {}
  for name, params in variants.items():
    step_bytes = decode_step_weight_bytes(params)
    rows[name] = dict(decode_tokens_per_s=best[name], decode_step_weight_bytes=step_bytes,
                      weight_gb_per_s=step_bytes * best[name] / 1e9)
    print(f"speed {config.name} {name:10s} " +
          " ".join(f"{k} {v:.4g}" for k, v in rows[name].items()), flush=True)
  return config.name, rows


def _claims(kv, weights, speed):
  rows = []
  if kv:
    bf16_kv = kv["bf16"]["cache_bytes_per_token"]
    rows += [("C6", "KV int8 / bf16 bytes per token (scales included)", "1/2",
              kv["int8"]["cache_bytes_per_token"] / bf16_kv),
             ("C6", "KV int4 / bf16 bytes per token (scales included)", "1/4",
              kv["int4"]["cache_bytes_per_token"] / bf16_kv)]
  for section, model in ((weights, "default model"), (speed and speed[1], "speed model")):
    for name in ("int4-g128", "int4-g32"):
      if section and name in section:
        rows.append(("C12", f"bf16 / {name} weight bytes per decode step ({model})", "4",
                     section["bf16"]["decode_step_weight_bytes"] /
                     section[name]["decode_step_weight_bytes"]))
  if speed and "int4-g128" in speed[1]:
    rows.append(("C12", f"int4-g128 / bf16 decode tokens/s ({speed[0]})", "~4",
                 speed[1]["int4-g128"]["decode_tokens_per_s"] /
                 speed[1]["bf16"]["decode_tokens_per_s"]))
  return common.claim_rows(rows)


def _plot(kv, weights, speed, path):
  panels = [p for p in (kv and "kv", weights and "weights", speed and "speed") if p]
  with common.figure(path, 1, len(panels), figsize=(5 * len(panels), 4), squeeze=False) as (
      _, axes):
    _draw(axes, panels, kv, weights, speed)


def _draw(axes, panels, kv, weights, speed):
  for ax, panel in zip(axes[0], panels):
    if panel == "kv":
      names = list(kv)
      ax.bar(names, [kv[n]["cache_bytes_per_token"] for n in names])
      for i, n in enumerate(names):
        ax.annotate(f"bpb {kv[n]['heldout_bits_per_byte']:.4f}",
                    (i, kv[n]["cache_bytes_per_token"]), ha="center", va="bottom")
      ax.set_title("KV bytes per cached token (default model)")
    else:
      rows = weights if panel == "weights" else speed[1]
      metric = "heldout_bits_per_byte" if panel == "weights" else "decode_tokens_per_s"
      for n, row in rows.items():
        ax.scatter(row["decode_step_weight_bytes"] / 1e6, row[metric])
        ax.annotate(n, (row["decode_step_weight_bytes"] / 1e6, row[metric]))
      ax.set_xlabel("weight MB read per decode step")
      ax.set_ylabel(metric.replace("_", " "))
      ax.set_title("weight-only quantization" + ("" if panel == "weights" else
                                                 f": speed ({speed[0]})"))


def main(_):
  cfg = _CONFIG.value
  start = time.perf_counter()
  model = kvjax.load_checkpoint(cfg.model or None) if (
      "kv" in cfg.sections or "weights" in cfg.sections or not cfg.speed_preset) else None
  kv, weights, speed = {}, {}, None
  if "kv" in cfg.sections or "weights" in cfg.sections:
    manifest = code_corpus.load_manifest(cfg.corpus_manifest)
    pack = os.path.expanduser(cfg.corpus_pack)
    windows = corpus_lib.heldout_slice(code_corpus.split_tokens(manifest, pack, "heldout"),
                                       cfg.seq_len, cfg.heldout_windows)
    step = max(1, len(windows) // cfg.greedy_prompts)
    prompts = [list(map(int, w[:cfg.greedy_prompt_len]))
               for w in windows[::step][:cfg.greedy_prompts]]
  if "kv" in cfg.sections:
    kv = _kv_section(cfg, model, windows, prompts)
  if "weights" in cfg.sections:
    train = code_corpus.split_tokens(manifest, pack, "train")
    calibration = corpus_lib.sample_batch(train, 0, 0, cfg.calibration_windows,
                                          cfg.seq_len)[:, :-1]
    weights = _weight_section(cfg, model, windows, calibration)
  if "speed" in cfg.sections:
    speed = _speed_section(cfg, model)
  claims = _claims(kv, weights, speed)
  print()
  common.print_claims(claims, "{claim:5s} {what:62s} {seed:>5s} {ours:>7s}", "{:.3f}")
  result = dict(config=cfg.to_dict(), model=model and model.config.name,
                device=common.device_label(), seconds=time.perf_counter() - start,
                kv_cache=kv, weights=weights, speed_model=speed and speed[0],
                speed=speed and speed[1], claims=claims)
  common.write_results(cfg.out_dir, cfg.name, result,
                       plot=functools.partial(_plot, kv, weights, speed))


if __name__ == "__main__":
  app.run(main)
