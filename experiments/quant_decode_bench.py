"""Issue 27 item 4: batch-1 and batch-8 decode tokens/s with float32, int8 and int4
weights on SmolLM2-135M-Instruct (goal: quantized weights clearly faster than float32,
toward llama.cpp's 97 tok/s at batch 1 on the issue's 2-core CPU).

Per weight dtype: tokens/s of `kvjax.generate` (greedy, one prompt per row) per
batch, interleaved rounds, median; weight bytes one decode step reads; and the
temp bytes XLA allocates for the decode-loop program compiled with kvjax's step
options and with main's before this change (the default concurrency-optimized
scheduler), which is where dequantized float copies of the weights would live.
Quantized decode steps multiply through kvjax/quant/qmatmul.py's custom call (the
codes read once; `qmatmul_available` in the results says it ran) and a tied head is
int8 codes (kvjax/weights/quantize.py tied_head).
Writes results/<name>.json and .png; says which CPU ran it (the machine is shared).
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
import kvjax
from kvjax.attention.backends import get_backend
from kvjax.caches import create_paged_cache
from kvjax.quant import qmatmul
from kvjax.runtime import generation
from kvjax.runtime.sampling import SamplingParams
from kvjax.runtime.step_batch import make_step_batch
from kvjax.runtime.xla_options import step_compiler_options
from kvjax.weights.quantize import decode_step_weight_bytes

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/quant_decode_bench.py", "experiment config", lock_config=True)

# kvjax/runtime/xla_options.py's decode options on main before the memory-optimized scheduler.
_MAIN_DECODE_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type":
                        "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def _decode_loop_temp_bytes(model, steps: int, options: dict) -> int:
  """Temp bytes of the batch-1 decode loop of `model` compiled with `options`."""
  cfg = model.config
  kv = create_paged_cache(cfg, None, 1, 5, 16, jnp.float32)
  sampling = SamplingParams.make(1, temperature=0.0, top_k=None, top_p=None, seeds=[0])
  batch = make_step_batch(np.ones((1, 1), np.int32), [5], [1], np.arange(1, 5)[None], [0],
                          sampling)
  program = jax.jit(generation._decode_loop.__wrapped__, compiler_options=options or None,
                    static_argnames=("config", "backend", "max_steps", "use_filter"))
  compiled = program.lower(model.params, kv, batch, jnp.int32(steps - 1), jnp.int32(-1),
                           config=cfg, backend=get_backend("reference"), max_steps=steps,
                           use_filter=False).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def _tokens_per_s(model, prompts, new_tokens):
  stats = kvjax.generate(model, prompts, new_tokens).stats
  return len(prompts) / stats["tpot_s"]


def _isas() -> tuple:
  """The qmatmul kernels this CPU runs (the call picks the last)."""
  return qmatmul.supported_isas() if qmatmul.available() else ()


def _plot(rows, batches, path):
  with common.figure(path, 1, len(batches), figsize=(5 * len(batches), 4),
                     squeeze=False) as (_, axes):
    for ax, b in zip(axes[0], batches):
      names = list(rows)
      ax.bar(names, [rows[n][f"batch_{b}_tokens_per_s"] for n in names])
      ax.set_title(f"SmolLM2-135M decode, batch {b}")
      ax.set_ylabel("tokens/s (median)")


def main(_):
  cfg = _CONFIG.value
  start, load_at_start = time.perf_counter(), list(os.getloadavg())
  models = {d: kvjax.load_checkpoint(cfg.checkpoint,
                                     weight_dtype=None if d == "float32" else d)
            for d in cfg.weight_dtypes}
  vocab = next(iter(models.values())).config.vocab_size
  rows = {d: dict(decode_step_weight_bytes=decode_step_weight_bytes(m.params))
          for d, m in models.items()}
  ours = dict(step_compiler_options("decode"))
  for d, m in models.items():
    rows[d]["decode_loop_temp_bytes"] = _decode_loop_temp_bytes(m, cfg.temp_loop_steps, ours)
    rows[d]["decode_loop_temp_bytes_main_options"] = _decode_loop_temp_bytes(
        m, cfg.temp_loop_steps, _MAIN_DECODE_OPTIONS)
    print(f"{d:8s} step weight MB {rows[d]['decode_step_weight_bytes'] / 1e6:.1f} "
          f"decode-loop temp MB {rows[d]['decode_loop_temp_bytes'] / 1e6:.1f} "
          f"(main's options {rows[d]['decode_loop_temp_bytes_main_options'] / 1e6:.1f})",
          flush=True)
  for b in cfg.batches:
    prompts = [[int(t) % vocab for t in range(100 + i, 100 + i + cfg.prompt_len)]
               for i in range(b)]
    timed = common.interleaved({
        d: functools.partial(_tokens_per_s, m, prompts, cfg.new_tokens)
        for d, m in models.items()}, cfg.repeats)
    for d in models:
      rows[d][f"batch_{b}_tokens_per_s"] = common.median(timed.results[d])
      rows[d][f"batch_{b}_tokens_per_s_rounds"] = timed.results[d]
      print(f"{d:8s} batch {b}: {rows[d][f'batch_{b}_tokens_per_s']:.1f} tok/s "
            f"(rounds {[round(x, 1) for x in timed.results[d]]})", flush=True)
  claims = []
  for d in models:
    if d != "float32" and "float32" in models:
      for b in cfg.batches:
        claims.append(("27.4", f"{d} / float32 decode tok/s, batch {b}", ">1",
                       rows[d][f"batch_{b}_tokens_per_s"] /
                       rows["float32"][f"batch_{b}_tokens_per_s"]))
  claims = common.claim_rows(claims)
  print()
  common.print_claims(claims, "{claim:5s} {what:44s} {seed:>5s} {ours:>7s}", "{:.3f}")
  result = dict(config=cfg.to_dict(), device=common.device_label(),
                device_info=common.describe_device(), shared_machine=True,
                load_average_at_start=load_at_start,
                qmatmul_available=qmatmul.available(), qmatmul_isas=_isas(),
                seconds=time.perf_counter() - start, rows=rows, claims=claims)
  common.write_results(cfg.out_dir, cfg.name, result,
                       plot=functools.partial(_plot, rows, cfg.batches))


if __name__ == "__main__":
  app.run(main)
