"""Issue 4 / claim C9: paged-attention decode bandwidth and verify cost on one GPU.

Sections, each appended to results/<name>.json as soon as it is done:
  checks   on-device correctness of ragged_paged_attention (compiled) against
           its reference and jax's paged_attention; rejection_sample against its
           reference at vocab 151,936.
  tune     a small sweep of our kernel's static tiling at one (batch, context).
  decode   achieved HBM bandwidth (bytes of K, V and q read / median time) of
           ours, jax's paged_attention and an XLA gather baseline, at every
           (batch, context); ours also at q_len 3 (speculative verify, C9).
  mosaic   the Mosaic GPU (plgpu) page-streaming kernel of
           pallas_kernels/mosaic_decode.py: does it lower and run under this
           jax, and at what bandwidth.
Prints the C9 row (seed ~1x vs ours) and the issue's goals, and plots a PNG.
"""
import functools
import json
import os
import time

from absl import app
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from pallas_kernels import mosaic_decode
from pallas_kernels import paged_attention as rpa_lib
from pallas_kernels import spec_verify
from pallas_kernels.paged_attention_reference import ragged_paged_attention_reference


def _timeit(cfg, fn, *args):
  """Median seconds per call over cfg.repeats runs of cfg.inner back-to-back calls."""
  return common.median_seconds(functools.partial(fn, *args), cfg.repeats, warmup=cfg.warmup,
                               inner=cfg.inner, block=jax.block_until_ready)


def _decode_problem(cfg, pool, batch, context, q_len, key):
  """q [B*q_len, N, H], full-context sequences on random pages of the pool."""
  k_pages, _ = pool
  pages_per_seq = context // cfg.page_size
  k_perm, k_q = jax.random.split(key)
  tables = jax.random.permutation(k_perm, k_pages.shape[1])[:batch * pages_per_seq]
  tables = tables.reshape(batch, pages_per_seq).astype(jnp.int32)  # [B, pps]
  q = jax.random.normal(k_q, (batch * q_len, cfg.num_q_heads, cfg.head_dim),
                        jnp.dtype(cfg.dtype))
  kv_lens = jnp.full((batch,), context, jnp.int32)
  cu = (jnp.arange(batch + 1) * q_len).astype(jnp.int32)
  return q, kv_lens, tables, cu


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def xla_gather_decode(q, k_pages, v_pages, kv_lens, tables, *, sm_scale):
  """Baseline: gather each sequence's pages with XLA, then dense masked softmax."""
  batch, num_q_heads, head_dim = q.shape  # [B, N, H]
  num_kv_heads = k_pages.shape[0]
  k = k_pages[:, tables].reshape(num_kv_heads, batch, -1, head_dim)  # [K, B, L, H]
  v = v_pages[:, tables].reshape(num_kv_heads, batch, -1, head_dim)
  qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
  s = jnp.einsum("bkgh,kblh->bkgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
  mask = jnp.arange(k.shape[2])[None, :] < kv_lens[:, None]  # [B, L]
  s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  o = jnp.einsum("bkgl,kblh->bkgh", p, v, preferred_element_type=jnp.float32)
  return o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def mosaic_probe(cfg):
  """Correctness and bandwidth of the Mosaic GPU decode kernel beside our Triton kernel."""
  out = {}
  dtype = jnp.dtype(cfg.dtype)
  n, kh, hd, ps = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size
  sm_scale = hd ** -0.5
  try:
    b, pps = 4, 64
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((b, n, hd)), dtype)
    k = jnp.asarray(rng.standard_normal((kh, b * pps, ps, hd)), dtype)
    v = jnp.asarray(rng.standard_normal((kh, b * pps, ps, hd)), dtype)
    tables = jnp.asarray(rng.permutation(b * pps).reshape(b, pps), jnp.int32)
    lens, cu = jnp.full((b,), pps * ps, jnp.int32), jnp.arange(b + 1, dtype=jnp.int32)
    got = mosaic_decode.mosaic_paged_decode(q, k, v, tables, sm_scale=sm_scale)
    want = ragged_paged_attention_reference(q, k, v, lens, tables, cu,
                                                    sm_scale=sm_scale)
    out["max_err_vs_reference"] = _err(got, want)
  except Exception as e:  # pylint: disable=broad-except
    out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    return out
  rows = []
  for batch, context in ((64, 8192), (64, 32768), (8, 32768)):
    pages = batch * context // ps
    shape = (kh, pages, ps, hd)
    k = jax.random.normal(jax.random.key(20), shape, dtype)
    v = jax.random.normal(jax.random.key(21), shape, dtype)
    q, lens, tables, cu = _decode_problem(cfg, (k, v), batch, context, 1, jax.random.key(22))
    nbytes = 2 * k.size * dtype.itemsize + q.size * dtype.itemsize
    for slots in (2, 4):
      fn = functools.partial(mosaic_decode.mosaic_paged_decode, sm_scale=sm_scale, slots=slots)
      try:
        sec = _timeit(cfg, fn, q, k, v, tables)
        rows.append(dict(batch=batch, context=context, slots=slots, ms=sec * 1e3,
                         tb_s=nbytes / sec / 1e12))
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(batch=batch, context=context, slots=slots,
                         error=f"{type(e).__name__}: {str(e)[:300]}"))
      print("mosaic", rows[-1], flush=True)
    del k, v
  out["rows"] = rows
  return out


def _backend_fn(cfg, name, sm_scale, tune):
  if name == "ours":
    return functools.partial(rpa_lib.ragged_paged_attention, sm_scale=sm_scale,
                             interpret=cfg.interpret, **tune)
  if name == "jax":
    from jax.experimental.pallas.ops.gpu import (  # pylint: disable=g-import-not-at-top
        paged_attention as jax_pa)
    fn = functools.partial(jax_pa.paged_attention, interpret=cfg.interpret)
    return jax.jit(lambda q, k, v, lens, tables, cu: fn(q * sm_scale, k, v, tables, lens))
  if name == "xla":
    return lambda q, k, v, lens, tables, cu: xla_gather_decode(
        q, k, v, lens, tables, sm_scale=sm_scale)
  raise ValueError(f"unknown backend {name!r}")


def _tune_kwargs(entry):
  ppb, pps, warps, stages = entry
  return dict(pages_per_block=ppb, pages_per_split=pps, num_warps=warps, num_stages=stages)


def _window40(q_pos, kv_pos):  # a 40-key sliding window, as kvjax's variant states it
  return kv_pos > q_pos - 40


def _window40_range(q_pos):  # the pages behind the window are skipped, not masked
  return q_pos - 39, q_pos + 1


def _err(a, b):
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _guarded(out, name, fn):
  """Runs one check; an exception is recorded under `name` instead of ending the run."""
  try:
    out.update(fn())
  except Exception as e:  # pylint: disable=broad-except
    out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:600]}"
  print(name, {k: v for k, v in out.items() if k.startswith(name)}, flush=True)


def run_checks(cfg, sm_scale):
  """Compiled kernels vs references on the device; returns a dict of max errors."""
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(cfg.dtype)
  n, kh, hd, ps = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.page_size
  rpa = functools.partial(rpa_lib.ragged_paged_attention, sm_scale=sm_scale,
                          interpret=cfg.interpret)
  ref = functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale)
  q_lens = np.array([1, 4, 0, 7, 1, 1, 16, 1, 0, 3, 130, 1], np.int32)
  kv_lens = np.array([17, 16, 5, 40, 1, 15, 16, 33, 0, 31, 300, 1000], np.int32)
  pps = -(-kv_lens.max() // ps)
  num_pages = len(kv_lens) * pps + 1
  tables = rng.permutation(num_pages)[:len(kv_lens) * pps].reshape(-1, pps).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  total = int(cu[-1]) + 2
  q = jnp.asarray(rng.standard_normal((total, n, hd)), dtype)
  k = jnp.asarray(rng.standard_normal((kh, num_pages, ps, hd)), dtype)
  v = jnp.asarray(rng.standard_normal((kh, num_pages, ps, hd)), dtype)
  meta = (jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu))
  out = {}

  def mixed():
    want = ref(q, k, v, *meta)
    s = 10  # batch invariance: sequence 10 alone vs inside the batch
    alone = rpa(q[cu[s]:cu[s + 1]], k, v, meta[0][s:s + 1], meta[1][s:s + 1],
                jnp.array([0, q_lens[s]], jnp.int32))
    full = rpa(q, k, v, *meta)
    return dict(rpa_mixed_max_err=_err(full, want),
                rpa_kv_swapped_max_err=_err(rpa(q, v, k, *meta), want),  # must be large
                rpa_batch_invariance_max_diff=_err(alone, full[cu[s]:cu[s + 1]]))

  def window_cap():  # the window as kvjax passes it: position rules
    kw = dict(mask_fn=_window40, soft_cap=20.0)
    return dict(rpa_window40_cap20_max_err=_err(
        rpa(q, k, v, *meta, kv_range_fn=_window40_range, **kw), ref(q, k, v, *meta, **kw)))

  def int8():
    k8 = jnp.asarray(rng.integers(-127, 128, k.shape), jnp.int8)
    v8 = jnp.asarray(rng.integers(-127, 128, k.shape), jnp.int8)
    kw = dict(k_scales=jnp.asarray(rng.uniform(0.002, 0.02, k.shape[:3]), jnp.float32),
              v_scales=jnp.asarray(rng.uniform(0.002, 0.02, k.shape[:3]), jnp.float32))
    return dict(rpa_int8_max_err=_err(rpa(q, k8, v8, *meta, **kw),
                                      ref(q, k8, v8, *meta, **kw)))

  def decode_vs_jax():
    b, ctx = 8, 1024
    kp = jnp.asarray(rng.standard_normal((kh, b * ctx // ps, ps, hd)), dtype)
    vp = jnp.asarray(rng.standard_normal((kh, b * ctx // ps, ps, hd)), dtype)
    qd, _, tb, cud = _decode_problem(cfg, (kp, vp), b, ctx, 1, jax.random.key(1))
    lens = jnp.asarray(rng.integers(1, ctx + 1, b), jnp.int32)
    want = ref(qd, kp, vp, lens, tb, cud)
    theirs = _backend_fn(cfg, "jax", sm_scale, {})(qd, kp, vp, lens, tb, cud)
    return dict(decode_ours_vs_ref_max_err=_err(rpa(qd, kp, vp, lens, tb, cud), want),
                decode_jax_vs_ref_max_err=_err(theirs, want))

  def sampler():  # at a real vocab: kernel vs reference on identical noise
    bsz, nk, vocab = cfg.rs_batch, cfg.rs_num_draft, cfg.check_rs_vocab
    logits = jnp.asarray(rng.standard_normal((bsz, nk + 1, vocab)) * 3, jnp.float32)
    dprobs = jax.nn.softmax(logits[:, :nk] + jnp.asarray(
        rng.standard_normal((bsz, nk, vocab)), jnp.float32), axis=-1)
    drafts = jax.random.categorical(jax.random.key(2), jnp.log(dprobs)).astype(jnp.int32)
    nd = jnp.asarray(rng.integers(0, nk + 1, bsz), jnp.int32)
    temp = jnp.asarray(rng.choice([0.0, 1.0], bsz), jnp.float32)
    keys = jax.random.split(jax.random.key(3), bsz)  # one PRNG key per row
    args = (drafts, dprobs, logits.astype(jnp.bfloat16), nd, keys)
    kernel = functools.partial(spec_verify.rejection_sample, temperature=temp,
                               interpret=cfg.interpret)
    reference = functools.partial(spec_verify.rejection_sample_reference, temperature=temp)
    got, want = kernel(*args), reference(*args)
    res = dict(rs_tokens_equal_frac=float(jnp.mean(got[0] == want[0])),
               rs_num_accepted_equal_frac=float(jnp.mean(got[1] == want[1])),
               rs_max_id=int(got[0].max()), rs_vocab=vocab,
               rs_kernel_ms=1e3 * _timeit(cfg, kernel, *args),
               rs_reference_ms=1e3 * _timeit(cfg, reference, *args))
    sweep = {}
    for block_v, chunk_tiles, warps, stages in cfg.rs_tune:
      fn = functools.partial(kernel, block_v=block_v, chunk_tiles=chunk_tiles,
                             num_warps=warps, num_stages=stages)
      sweep[f"{block_v}_{chunk_tiles}_{warps}_{stages}"] = 1e3 * _timeit(cfg, fn, *args)
    res["rs_tune_ms"] = sweep  # block_v_chunk_tiles_warps_stages -> ms
    return res

  def shapes():  # other head dims / page sizes compile and agree on the device
    res = {}
    for hd2, ps2 in ((64, 8), (256, 128), (128, 32)):
      r = np.random.default_rng(hd2)
      pages = 3 * (-(-1000 // ps2)) + 1
      tb = r.permutation(pages)[:pages - 1].reshape(3, -1).astype(np.int32)
      args = (jnp.asarray(r.standard_normal((13, 8, hd2)), dtype),
              jnp.asarray(r.standard_normal((2, pages, ps2, hd2)), dtype),
              jnp.asarray(r.standard_normal((2, pages, ps2, hd2)), dtype),
              jnp.array([1000, 5, 77], jnp.int32), jnp.asarray(tb),
              jnp.array([0, 1, 5, 12], jnp.int32))
      res[f"shapes_hd{hd2}_page{ps2}_max_err"] = _err(
          rpa_lib.ragged_paged_attention(*args, sm_scale=hd2 ** -0.5, interpret=cfg.interpret),
          ragged_paged_attention_reference(*args, sm_scale=hd2 ** -0.5))
    return res

  _guarded(out, "rpa_mixed", mixed)
  if cfg.check_shapes:
    _guarded(out, "shapes", shapes)
  _guarded(out, "rpa_window", window_cap)
  _guarded(out, "rpa_int8", int8)
  if "jax" in cfg.backends:
    _guarded(out, "decode", decode_vs_jax)
  _guarded(out, "rs", sampler)
  return out


def run_decode(cfg, sm_scale, results, save):
  """Tune ours at one point, then the (batch, context) grid for every backend."""
  dtype = jnp.dtype(cfg.dtype)
  max_pages = max(cfg.batches) * max(cfg.contexts) // cfg.page_size
  shape = (cfg.num_kv_heads, max_pages, cfg.page_size, cfg.head_dim)
  k_pool = jax.random.normal(jax.random.key(10), shape, dtype)
  v_pool = jax.random.normal(jax.random.key(11), shape, dtype)
  pool = (k_pool, v_pool)
  itemsize = dtype.itemsize

  def kv_bytes(batch, context, q_len):
    kv = 2 * batch * context * cfg.num_kv_heads * cfg.head_dim * itemsize
    return kv + batch * q_len * cfg.num_q_heads * cfg.head_dim * itemsize

  def measure(backend, batch, context, q_len, tune):
    q, lens, tables, cu = _decode_problem(cfg, pool, batch, context, q_len,
                                          jax.random.key(batch * 7 + context))
    fn = _backend_fn(cfg, backend, sm_scale, tune)
    try:
      sec = _timeit(cfg, fn, q, k_pool, v_pool, lens, tables, cu)
    except Exception as e:  # pylint: disable=broad-except
      return dict(backend=backend, batch=batch, context=context, q_len=q_len,
                  error=f"{type(e).__name__}: {str(e)[:300]}")
    nbytes = kv_bytes(batch, context, q_len)
    return dict(backend=backend, batch=batch, context=context, q_len=q_len,
                ms=sec * 1e3, bytes=nbytes, tb_s=nbytes / sec / 1e12,
                pct_peak=100 * nbytes / sec / 1e12 / cfg.peak_tb_s)

  tune_rows = []
  for entry in cfg.tune:
    row = measure("ours", cfg.tune_batch, cfg.tune_context, 1, _tune_kwargs(entry))
    row["tune"] = list(entry)
    tune_rows.append(row)
    print("tune", entry, row.get("tb_s", row.get("error")), flush=True)
  ok = [r for r in tune_rows if "tb_s" in r]
  best = max(ok, key=lambda r: r["tb_s"]) if ok else None
  if best and "tb_s" in tune_rows[0] and best["tb_s"] < 1.01 * tune_rows[0]["tb_s"]:
    best = tune_rows[0]  # keep the first entry (the default) unless >1% better
  best = best["tune"] if best else None
  results["tune"] = dict(rows=tune_rows, best=best)
  save()
  best_kw = _tune_kwargs(best) if best else {}
  rows = []
  for batch in cfg.batches:
    for context in cfg.contexts:
      for backend in cfg.backends:
        q_lens = cfg.verify_q_lens if backend == "ours" else (1,)
        for q_len in q_lens:
          row = measure(backend, batch, context, q_len, best_kw if backend == "ours" else {})
          rows.append(row)
          print(f"B={batch:3d} ctx={context:6d} {backend:5s} q_len={q_len} "
                f"{row.get('ms', float('nan')):8.3f} ms {row.get('tb_s', float('nan')):6.2f} "
                f"TB/s {row.get('error', '')}", flush=True)
      results["decode"] = rows
      save()
  return rows


def summarize(cfg, rows):
  """C9 ratio, speedup over jax's kernel, and the issue's bandwidth goals."""
  get = {(r["backend"], r["batch"], r["context"], r["q_len"]): r for r in rows}
  summary = dict(verify_ratio={}, speedup_vs_jax={}, speedup_vs_xla={}, pct_peak={})
  for batch in cfg.batches:
    for context in cfg.contexts:
      key = f"B{batch}_ctx{context}"
      q1, q3 = get.get(("ours", batch, context, 1)), get.get(("ours", batch, context, 3))
      if q1 and q3 and "ms" in q1 and "ms" in q3:
        summary["verify_ratio"][key] = q3["ms"] / q1["ms"]
      if q1 and "ms" in q1:
        summary["pct_peak"][key] = q1["pct_peak"]
        for other in ("jax", "xla"):
          r = get.get((other, batch, context, 1))
          if r and "ms" in r:
            summary[f"speedup_vs_{other}"][key] = r["ms"] / q1["ms"]
  big = [k for k in summary["pct_peak"] if k.startswith(f"B{max(cfg.batches)}_")
         and int(k.split("ctx")[1]) >= 8192]
  summary["goals"] = dict(
      bandwidth_85pct_at_B64_ctx_ge_8k=all(summary["pct_peak"][k] >= 85 for k in big)
      if big else None,
      speedup_1p5x_vs_jax=(min(summary["speedup_vs_jax"].values()) >= 1.5
                           if summary["speedup_vs_jax"] else None),
      verify_q3_le_1p15x_q1=(max(summary["verify_ratio"].values()) <= 1.15
                             if summary["verify_ratio"] else None))
  ratios = summary["verify_ratio"]
  ref_key = f"B{max(cfg.batches)}_ctx{sorted(cfg.contexts)[len(cfg.contexts) // 2]}"
  summary["c9"] = dict(claim="C9", what="cost of verifying 3 positions / one decode step",
                       seed="~1x", ours_at=ref_key, ours=ratios.get(ref_key),
                       ours_min=min(ratios.values()) if ratios else None,
                       ours_max=max(ratios.values()) if ratios else None)
  return summary


def plot(cfg, rows, summary, path):
  with common.figure(path, 1, 2, figsize=(13, 4.5), gridspec_kw=dict(width_ratios=[3, 1]),
                     dpi=110) as (_, (ax, ax2)):
    _draw(cfg, rows, summary, ax, ax2)


def _draw(cfg, rows, summary, ax, ax2):
  points = [(b, c) for b in cfg.batches for c in cfg.contexts]
  series = [("ours", 1), ("ours", 3), ("jax", 1), ("xla", 1)]
  width = 0.8 / len(series)
  get = {(r["backend"], r["batch"], r["context"], r["q_len"]): r for r in rows}
  for i, (backend, q_len) in enumerate(series):
    vals = [get.get((backend, b, c, q_len), {}).get("tb_s", 0.0) for b, c in points]
    ax.bar(np.arange(len(points)) + i * width, vals, width,
           label=f"{backend}" + (f" q_len={q_len}" if backend == "ours" else ""))
  ax.axhline(cfg.peak_tb_s, color="k", ls="--", lw=1, label=f"peak {cfg.peak_tb_s} TB/s")
  ax.axhline(0.85 * cfg.peak_tb_s, color="gray", ls=":", lw=1, label="85% of peak")
  ax.set_xticks(np.arange(len(points)) + 0.4 - width / 2)
  ax.set_xticklabels([f"B{b}\n{c // 1024}k" if c >= 1024 else f"B{b}\n{c}" for b, c in points])
  ax.set_ylabel("achieved HBM TB/s (K+V+q bytes / time)")
  ax.set_title(f"paged decode, {cfg.num_q_heads}q/{cfg.num_kv_heads}kv heads, "
               f"hd {cfg.head_dim}, {cfg.dtype}, page {cfg.page_size}")
  ax.legend(fontsize=7, ncol=2)
  ratios = summary["verify_ratio"]
  ax2.bar(range(len(ratios)), list(ratios.values()), color="tab:orange")
  ax2.axhline(1.15, color="gray", ls=":", lw=1, label="goal 1.15x")
  ax2.set_xticks(range(len(ratios)))
  ax2.set_xticklabels([k.replace("_ctx", "\n") for k in ratios], fontsize=7)
  ax2.set_title("C9: time(q_len 3) / time(q_len 1)")
  ax2.legend(fontsize=7)


def main(_):
  cfg = _CONFIG.value
  os.makedirs(cfg.out_dir, exist_ok=True)
  json_path = os.path.join(cfg.out_dir, f"{cfg.name}.json")
  results = dict(device=common.device_label(), jax_version=jax.__version__,
                 config=cfg.to_dict())

  def save():
    common.write_json(json_path, results)

  sm_scale = cfg.head_dim ** -0.5
  if cfg.check:
    start = time.perf_counter()
    results["checks"] = run_checks(cfg, sm_scale)
    results["checks"]["seconds"] = time.perf_counter() - start
    print("checks", json.dumps(results["checks"], indent=1), flush=True)
    save()
  if cfg.mosaic_trial:
    results["mosaic_trial"] = mosaic_probe(cfg)
    print("mosaic", results["mosaic_trial"], flush=True)
    save()
  rows = run_decode(cfg, sm_scale, results, save)
  summary = summarize(cfg, rows)
  results["summary"] = summary
  save()
  c9 = summary["c9"]
  print(f"\n{'claim':6s}{'what':50s}{'seed':>8s}{'ours':>10s}")
  ours = "n/a" if c9["ours"] is None else f"{c9['ours']:.3f}x"
  print(f"{c9['claim']:6s}{c9['what'] + ' @' + c9['ours_at']:50s}{c9['seed']:>8s}{ours:>10s}")
  if c9["ours_min"] is not None:
    print(f"      range over the grid: {c9['ours_min']:.3f}x .. {c9['ours_max']:.3f}x")
  print("goals:", summary["goals"])
  plot(cfg, rows, summary, os.path.join(cfg.out_dir, f"{cfg.name}.png"))
  print("wrote", json_path)


if __name__ == "__main__":
  # Defined here, not at import: tests import launchers side by side, and absl allows
  # one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/kernel_bench.py", "experiment config", lock_config=True)
  app.run(main)
