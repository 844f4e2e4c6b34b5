"""Issue 32 (start-up in seconds): what the sampling options cost a step program.

A server compiles a step program per packed shape.  Before, it compiled one
per combination of sampling options too (top-k / top-p filtering, logprobs:
static variants, 464 programs for the default model at its 2,048-token
context); now one program serves them all (kvjax/runtime/serve_steps.py: the filter
and the logprobs run under runtime conds), 116 programs.  This measures what
the options cost inside that program, where a step pays for them only when a
row asks: per checkpoint, the decode shape of a full batch and the smallest,
a middle and the largest prefill shape at the server's default context, every
row sampling at temperature 1, with nothing else asked vs top-p and logprobs
asked by every row; interleaved rounds, median.  Writes results/<name>.json
and .png; says which CPU ran it (the machine is shared).
"""
import functools
import time

from absl import app
from ml_collections import config_flags
import jax
import jax.numpy as jnp

from experiments import common
import kvjax

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/sampling_options_bench.py", "experiment config", lock_config=True)


def _shapes(engine):
  """The widest decode shape, and the smallest, a middle and the largest prefill shape."""
  shapes = engine.packing.shapes()
  prefill = sorted((s for s in shapes if s.kind == "prefill"),
                   key=lambda s: (s.rows * s.columns, s.width))
  decode = max((s for s in shapes if s.kind == "decode"), key=lambda s: (s.rows, s.width))
  return [decode, prefill[0], prefill[len(prefill) // 2], prefill[-1]]


def _batch(engine, shape, top_p):
  batch = engine.packing.padding(shape, snapshots=engine.snapshots is not None)
  ones = jnp.ones_like(batch.sampling.temperature)
  return batch.replace(sampling=batch.sampling.replace(temperature=ones, top_p=ones * top_p))


def _step(engine, batch, logprobs):
  emitted, _, _ = engine._run(batch, 0, logprobs)  # pylint: disable=protected-access
  return emitted.tokens


def _plot(rows, path):
  with common.figure(path, figsize=(8, 4)) as (_, ax):
    labels = [f"{r['checkpoint']}\n{r['kind']} B{r['rows']} T{r['columns']}" for r in rows]
    ax.bar(labels, [r["ratio"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("step with top-p + logprobs / with none (median)")
    ax.set_title("Sampling options in the one step program: their price when asked")
    ax.tick_params(axis="x", labelsize=7)


def main(_):
  cfg = _CONFIG.value
  start = time.perf_counter()
  rows = []
  for name in cfg.checkpoints:
    model = kvjax.load_checkpoint(None if name == "default" else name)
    engine = kvjax.Engine(
        model, max_model_len=min(cfg.max_model_len, model.config.max_position_embeddings))
    for shape in _shapes(engine):
      runs = {"none": functools.partial(_step, engine, _batch(engine, shape, 1.0), False),
              "asked": functools.partial(_step, engine, _batch(engine, shape, cfg.top_p), True)}
      medians = common.interleaved(runs, cfg.repeats, block=jax.block_until_ready).medians()
      rows.append(dict(checkpoint=name, kind=shape.kind, rows=shape.rows, columns=shape.columns,
                       width=shape.width, none_s=medians["none"], asked_s=medians["asked"],
                       ratio=medians["asked"] / medians["none"], vocab=model.config.vocab_size))
      print(f"{name:24s} {shape.kind:7s} B {shape.rows:3d} T {shape.columns:5d} "
            f"W {shape.width:4d}: none {medians['none'] * 1e3:9.2f} ms, top-p + logprobs "
            f"{medians['asked'] * 1e3:9.2f} ms ({rows[-1]['ratio']:.3f}x)", flush=True)
  claims = common.claim_rows([
      ("32.2", f"{r['kind']} step, top-p + logprobs / none, {r['checkpoint']} B{r['rows']} "
       f"T{r['columns']}", "paid when asked", r["ratio"]) for r in rows])
  print()
  common.print_claims(claims, "{claim:5s} {what:66s} {seed:>15s} {ours:>7s}", "{:.3f}")
  result = dict(config=cfg.to_dict(), device=common.device_label(),
                device_info=common.describe_device(), shared_machine=True,
                seconds=time.perf_counter() - start, rows=rows, claims=claims)
  common.write_results(cfg.out_dir, cfg.name, result, plot=functools.partial(_plot, rows))


if __name__ == "__main__":
  app.run(main)
