"""Issue 27 item 4, the micro-benchmark: [B, D] x [D, F] with quantized weights on XLA:CPU.

At SmolLM2-135M's shapes (w_up 576x1536, w_down 1536x576, the tied head 576x49152)
and B in {1, 8, 32} (32: qmatmul.MAX_ROWS, the widest decode / verify input it
takes), jitted variants side by side, each compiled with kvjax's decode
and prefill compiler options (kvjax/runtime/xla_options.py):
  float32          the float32 dot (the baseline; 4 B a weight)
  dequant-*        QuantizedWeight.dequantize then the dot: kvjax's path before qmatmul
  s8s8-int8        the activation row quantized to int8 (one scale a row), an
                   s8 x s8 -> s32 dot_general with the int8 per-channel codes, scales after
  s8s8-int8-g32    the same against int8 codes in groups of 32 rows (GGUF's blocks): a
                   dot batched over the groups, each group's s32 sums scaled, then summed
  s8s8T-int8       s8s8-int8 with the codes stored [F, D] (contracted axis minor)
  bf16-int8        the codes converted to bf16, a bf16 dot accumulating in f32, scales after
  qmatmul-*        kvjax/quant/qmatmul.cc, the custom call that streams the codes once
                   (int8 per channel; int4-g32 and int8-g32 with GGUF Q4_1's offsets)
Each program runs distinct copies of its weight until the float32 copies fill
cfg.cold_bytes, so weights come from DRAM as in a decode step.  Reported per variant:
microseconds per matmul, GB/s of its own weight bytes (codes, scales, offsets), and
its speedup over float32 (the claim rows: every batch, decode options).
"""
import functools
import os
import time

from absl import app
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from kvjax.quant import qmatmul
from kvjax.quant.qweight import quantize_weight
from kvjax.runtime.xla_options import step_compiler_options

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quant_matvec_bench.py", "experiment config", lock_config=True)


def _quantize_rows(x):
  """x [B, D] -> (int8 codes, f32 scales [B, 1]): one absmax scale per activation row."""
  scale = jnp.maximum(jnp.max(jnp.abs(x), -1, keepdims=True), 1e-30) / 127
  return jnp.round(x / scale).astype(jnp.int8), scale


def _dequant_dot(x, q):
  x, q = jax.lax.optimization_barrier((x, q))  # as layers.dense: beside its dot
  return jnp.dot(x, q.dequantize(jnp.float32), precision="highest")


def _s8s8(x, q):
  xq, a = _quantize_rows(x)
  y = jax.lax.dot_general(xq, q.codes, (((1,), (0,)), ((), ())),
                          preferred_element_type=jnp.int32)
  return y.astype(jnp.float32) * a * q.scales


def _s8s8_grouped(x, q):
  xq, a = _quantize_rows(x)
  groups, cols = q.scales.shape
  xg = xq.reshape(x.shape[0], groups, -1)  # [B, G, g]
  cg = q.codes.reshape(groups, -1, cols)  # [G, g, F]
  y = jax.lax.dot_general(xg, cg, (((2,), (1,)), ((1,), (0,))),
                          preferred_element_type=jnp.int32)  # [G, B, F]
  return jnp.sum(y.astype(jnp.float32) * q.scales[:, None], 0) * a


def _s8s8_transposed(x, codes_t, scales):
  xq, a = _quantize_rows(x)
  y = jax.lax.dot_general(xq, codes_t, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.int32)
  return y.astype(jnp.float32) * a * scales


def _bf16(x, q):
  y = jnp.dot(x.astype(jnp.bfloat16), q.codes.astype(jnp.bfloat16),
              preferred_element_type=jnp.float32)
  return y * q.scales


def _with_offsets(q):
  """GGUF Q4_1 as kvjax keeps it: codes q - 8 with offset m + 8d per group."""
  return q.replace(offsets=q.scales * 0.5)


def _variants(w):
  """name -> (weight argument, fn(x, weight) -> [B, F], weight bytes)."""
  int8 = quantize_weight(w, num_in=1, bits=8, group_size=None)
  int8_g32 = quantize_weight(w, num_in=1, bits=8, group_size=32)
  int4 = quantize_weight(w, num_in=1, bits=4, group_size=32)
  transposed = (jnp.asarray(np.asarray(int8.codes).T.copy()), int8.scales)
  variants = {
      "float32": (w, lambda x, v: jnp.dot(x, v, precision="highest"), 4 * w.size),
      "dequant-int8": (int8, _dequant_dot, int8.nbytes),
      "dequant-int4-g32": (int4, _dequant_dot, int4.nbytes),
      "s8s8-int8": (int8, _s8s8, int8.nbytes),
      "s8s8-int8-g32": (int8_g32, _s8s8_grouped, int8_g32.nbytes),
      "s8s8T-int8": (transposed, lambda x, v: _s8s8_transposed(x, *v), int8.nbytes),
      "bf16-int8": (int8, _bf16, int8.nbytes),
  }
  if qmatmul.available():
    for name, q in (("int8", int8), ("int8-g32-offsets", _with_offsets(int8_g32)),
                    ("int4-g32", int4), ("int4-g32-offsets", _with_offsets(int4))):
      variants[f"qmatmul-{name}"] = (q, qmatmul.qmatmul, q.nbytes)
  return variants


def _copies(weight, count):
  """`count` distinct device copies of a weight pytree (no two share a buffer)."""
  return [jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True) + jnp.zeros((), a.dtype),
                                 weight) for _ in range(count)]


def _program(fn, options):
  """jit of sum_k fn(x, weights[k]), every copy's matmul in one program."""
  return jax.jit(lambda x, weights: sum(fn(x, v) for v in weights),
                 compiler_options=dict(step_compiler_options(options)) or None)


def _plot(rows, cfg, path):
  points = [(tuple(s), b) for s in cfg.shapes for b in cfg.batches]
  with common.figure(path, 1, len(points), figsize=(4.5 * len(points), 4.5),
                     squeeze=False) as (_, axes):
    for ax, (shape, b) in zip(axes[0], points):
      mine = [r for r in rows if tuple(r["shape"]) == shape and r["batch"] == b
              and r["options"] == "decode"]
      ax.barh([r["variant"] for r in mine], [r["weight_gb_per_s"] for r in mine])
      ax.set_title(f"[{b}, {shape[0]}] x [{shape[0]}, {shape[1]}], decode options",
                   fontsize=9)
      ax.set_xlabel("GB/s of weight bytes read (median)")


def main(_):
  cfg = _CONFIG.value
  start, load_at_start = time.perf_counter(), list(os.getloadavg())
  rng = np.random.default_rng(0)
  rows, claims = [], []
  for d, f in cfg.shapes:
    w = jnp.asarray(rng.standard_normal((d, f)) / np.sqrt(d), jnp.float32)
    count = max(2, -(-cfg.cold_bytes // (4 * d * f)))
    known = _variants(w)
    unknown = set(cfg.variants) - set(known)
    if unknown or (cfg.variants and "float32" not in cfg.variants):
      raise ValueError(f"config.variants={cfg.variants}: {sorted(unknown)} not one of "
                       f"{sorted(known)}, or no float32 (the baseline every row divides)")
    variants = {name: (_copies(v, count), fn, nbytes) for name, (v, fn, nbytes) in known.items()
                if not cfg.variants or name in cfg.variants}
    for b in cfg.batches:
      x = jnp.asarray(rng.standard_normal((b, d)), jnp.float32)
      runs = {(name, o): functools.partial(_program(fn, o), x, weights)
              for o in cfg.option_sets for name, (weights, fn, _) in variants.items()}
      timed = common.interleaved(runs, cfg.repeats, block=jax.block_until_ready)
      seconds = {k: s / count for k, s in timed.medians().items()}
      for (name, o), s in seconds.items():
        nbytes = variants[name][2]
        rows.append(dict(shape=[d, f], batch=b, options=o, variant=name, copies=count,
                         weight_bytes=nbytes, us=s * 1e6, weight_gb_per_s=nbytes / s / 1e9,
                         speedup_vs_float32=seconds[("float32", o)] / s))
        print(f"[{b}, {d}] x [{d}, {f}] {o:7s} {name:24s} {s * 1e6:8.1f} us "
              f"{nbytes / s / 1e9:6.1f} GB/s  x{seconds[('float32', o)] / s:.2f} vs float32",
              flush=True)
      decode = {name: s for (name, o), s in seconds.items() if o == "decode"}
      xla_best = min((n for n in decode if n.startswith(("dequant", "s8s8", "bf16"))),
                     key=decode.get, default=None)
      ours = min((n for n in decode if n.startswith("qmatmul-int8")), key=decode.get,
                 default=xla_best)
      if ours is not None:
        claims.append(("27.4", f"{ours} / float32 speed, [{b},{d}]x[{d},{f}]", ">2",
                       decode["float32"] / decode[ours]))
      if xla_best is not None:
        claims.append(("27.4", f"best XLA int8 ({xla_best}) / float32, [{b},{d}]x[{d},{f}]",
                       ">1", decode["float32"] / decode[xla_best]))
  claims = common.claim_rows(claims)
  print()
  common.print_claims(claims, "{claim:5s} {what:62s} {seed:>4s} {ours:>6s}", "{:.2f}")
  result = dict(config=cfg.to_dict(), device=common.device_label(),
                device_info=common.describe_device(), shared_machine=True,
                load_average_at_start=load_at_start,
                qmatmul_available=qmatmul.available(),
                qmatmul_isas=qmatmul.supported_isas() if qmatmul.available() else (),
                seconds=time.perf_counter() - start,
                rows=rows, claims=claims)
  common.write_results(cfg.out_dir, cfg.name, result, plot=functools.partial(_plot, rows, cfg))


if __name__ == "__main__":
  app.run(main)
