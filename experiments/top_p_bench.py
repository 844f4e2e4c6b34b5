"""Issue 50, item 4: top-k / top-p sampling over a 262,144-token vocabulary.

The filter (kvjax/runtime/sampling.py filtered_logits) decides a batch from each row's
TOP_CANDIDATES largest logits (lax.top_k) when every row's top-k set and nucleus end
among them, and by bisection over the values otherwise; it used to sort the whole [B, V]
logits.  Per checkpoint, on the model's own next-token distributions at every position
of a text (kvjax.forward): for each (temperature, top_k, top_p) the share of rows the
candidates settle and of batches of `batch` consecutive rows (a batch bisects when any
row is not settled); then, on one batch of those rows at each setting, the filter's time
(and bisection's alone) against the sort (interleaved rounds, medians) beside a
batch-`batch` decode step of the Engine (its greedy tokens/s), and the Engine's decode
tokens/s sampled at one setting against greedy.
Writes results/<name>.json and .png.
"""
import functools
import time

from absl import app
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
import kvjax
from kvjax.runtime import sampling

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/top_p_bench.py", "experiment config", lock_config=True)


def _next_token_logits(model, text: str) -> np.ndarray:
  """[T, V] float32: the model's logits after each token of text."""
  ids = model.tokenizer.encode(text) if model.tokenizer else list(range(1, 65))
  return np.asarray(kvjax.forward(model, np.asarray([ids], np.int32))[0])


def _settled(logits: jnp.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """[T] bool: the rows TOP_CANDIDATES logits decide (filtered_logits' own test)."""
  rows, vocab = logits.shape
  k = jnp.full((rows,), top_k if top_k else vocab, jnp.int32)
  largest, _ = jax.lax.top_k(logits, min(sampling.TOP_CANDIDATES, vocab))
  _, settled = sampling.kept_threshold(largest, k, jnp.full((rows,), top_p), logits)
  return np.asarray(settled)


def _decode_rates(model, cfg) -> dict:
  """Decode tokens/s of `batch` requests continuing the text, greedy and sampled at
  cfg.decode_setting (interleaved rounds, medians)."""
  engine = kvjax.Engine(model, max_num_seqs=cfg.batch,
                        max_model_len=min(2048, model.config.max_position_embeddings))
  ids = model.tokenizer.encode(cfg.text) if model.tokenizer else list(range(1, 65))
  temperature, top_k, top_p = cfg.decode_setting

  def rate(**sampling):
    for row in range(cfg.batch):  # a different prompt each: no prefix-cache hits
      engine.add_request(ids[row:], cfg.new_tokens, seed=row, **sampling)
    return common.decode_tokens_per_s(engine, cfg.new_tokens)

  runs = {"greedy": rate,
          "sampled": functools.partial(rate, temperature=temperature, top_k=top_k,
                                       top_p=top_p)}
  timings = common.interleaved(runs, cfg.decode_rounds)
  return {name: common.median(values) for name, values in timings.results.items()}


def _filter_runs(logits: np.ndarray, batch: int, temperature: float, top_k: int,
                 top_p: float) -> dict:
  rows = jnp.asarray(logits[:batch] / temperature)
  k, p = jnp.full((batch,), top_k, jnp.int32), jnp.full((batch,), top_p, jnp.float32)
  vocab = logits.shape[-1]
  top_k = jnp.where(k > 0, k, vocab)
  filtered = jax.jit(sampling.filtered_logits)
  bisected = jax.jit(lambda x: jnp.where(x >= sampling.bisected_threshold(x, top_k, p), x,
                                         -jnp.inf))
  whole_sort = jax.jit(functools.partial(sampling.filtered_logits, candidates=vocab))
  return {"filter": lambda: filtered(rows, k, p), "bisection": lambda: bisected(rows),
          "sort": lambda: whole_sort(rows, k, p)}


def _plot(rows, path):
  with common.figure(path, figsize=(9, 4)) as (_, ax):
    labels = [f"{r['checkpoint']}\nT{r['temperature']} k{r['top_k']} p{r['top_p']}"
              for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["sort_share"] for r in rows], 0.4, label="whole-row sort")
    ax.bar(x + 0.2, [r["filter_share"] for r in rows], 0.4,
           label=f"{sampling.TOP_CANDIDATES} candidates, else bisection")
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("filter time / greedy decode step")
    ax.set_title("top-k / top-p filter's share of a batch decode step (median)")
    ax.legend()


def main(_):
  cfg = _CONFIG.value
  start = time.perf_counter()
  rows, decode = [], []
  for name in cfg.checkpoints:
    model = kvjax.load_checkpoint(name)
    logits = _next_token_logits(model, cfg.text)
    rates = _decode_rates(model, cfg)
    step_s = cfg.batch / rates["greedy"]
    print(f"{name}: vocabulary {logits.shape[-1]:,}, {len(logits)} positions; decode at batch "
          f"{cfg.batch}: greedy {rates['greedy']:.1f} tok/s ({step_s * 1e3:.0f} ms a step), "
          f"sampled {cfg.decode_setting}: {rates['sampled']:.1f} tok/s "
          f"({rates['sampled'] / rates['greedy']:.3f}x)", flush=True)
    decode.append(dict(checkpoint=name, greedy_tok_s=rates["greedy"],
                       sampled_tok_s=rates["sampled"],
                       ratio=rates["sampled"] / rates["greedy"]))
    for temperature, top_k, top_p in cfg.settings:
      settled = _settled(jnp.asarray(logits / temperature), top_k, top_p)
      batches = settled[:len(settled) // cfg.batch * cfg.batch].reshape(-1, cfg.batch)
      runs = _filter_runs(logits, cfg.batch, temperature, top_k, top_p)
      medians = common.interleaved(runs, cfg.repeats, block=jax.block_until_ready).medians()
      rows.append(dict(checkpoint=name, vocab=logits.shape[-1], temperature=temperature,
                       top_k=top_k, top_p=top_p, rows_settled=float(settled.mean()),
                       batches_settled=float(batches.all(axis=1).mean()),
                       first_rows_settled=bool(settled[:cfg.batch].all()),
                       decode_step_s=step_s, filter_s=medians["filter"],
                       bisection_s=medians["bisection"], sort_s=medians["sort"],
                       filter_share=medians["filter"] / step_s,
                       sort_share=medians["sort"] / step_s))
      r = rows[-1]
      how = "candidates" if r["first_rows_settled"] else "bisection"
      print(f"  T {temperature} top_k {top_k} top_p {top_p}: rows settled "
            f"{r['rows_settled']:.0%}, batches {r['batches_settled']:.0%}; the first batch "
            f"filtered ({how}) in {r['filter_s'] * 1e3:.1f} ms, bisection "
            f"{r['bisection_s'] * 1e3:.1f} ms, sort {r['sort_s'] * 1e3:.1f} ms "
            f"({r['filter_share']:.3f} / {r['sort_share']:.2f} of a step)", flush=True)
  claims = common.claim_rows([
      ("50.4", f"top-p filter / decode step, {r['checkpoint']} T{r['temperature']} "
       f"k{r['top_k']} p{r['top_p']}", "small", r["filter_share"]) for r in rows] + [
      ("50.4", f"sampled {cfg.decode_setting} / greedy decode tok/s, {d['checkpoint']}",
       "~1", d["ratio"]) for d in decode])
  print()
  common.print_claims(claims, "{claim:5s} {what:58s} {seed:>6s} {ours:>7s}", "{:.3f}")
  result = dict(config=cfg.to_dict(), device=common.device_label(),
                device_info=common.describe_device(), shared_machine=True,
                candidates=sampling.TOP_CANDIDATES, seconds=time.perf_counter() - start,
                rows=rows, decode=decode, claims=claims)
  common.write_results(cfg.out_dir, cfg.name, result, plot=functools.partial(_plot, rows))


if __name__ == "__main__":
  app.run(main)
