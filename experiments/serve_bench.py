"""Serving benchmark: engine vs HF, prefix-cache TTFT (C15), MTP speculation (C9-C10, C14).

(a) The default model converted to an HF LlamaForCausalLM with the same weights
    (the MTP heads dropped); the same held-out-code requests through HF
    `generate` in static batches (prompts left-padded to the batch's longest,
    every row generating the batch's longest output) and through kvjax.Engine
    (max_num_seqs = the HF batch); greedy, EOS off.  Two workloads: fixed
    lengths (HF's best case) and lengths drawn uniformly within +-range_ratio
    of the means (vLLM's random dataset), each at two concurrencies; useful
    output tokens/s (each request's own length).
(b) Chats of N turns (history + new user message per turn) through the engine
    with and without the prefix cache: mean TTFT per turn; goal: turn N's TTFT
    cut >= 5x by the cache.
(c) Continuations with and without MTP drafting at max_num_seqs 1, 8 and 32:
    fixed K = 2 and num_draft="auto" (the adaptive policy, its engine warmed up
    first: it may pick any program at any step): output tokens/s, acceptance
    length (seed C10: 2.39; goal >= 2.4) and speedup, both end to end (tok/s,
    prefill included: MTP also writes its own K/V there) and in decode (TPOT);
    and plain decoding with one device call per step (num_scheduler_steps 1):
    C13's replayed graph is, here, the multi-step device loop.
`:grown` runs part (c) alone on the default model grown to a 123M-parameter model that
computes the same logits (kvjax/weights/grow.py: its steps do the larger model's work,
its acceptance is the trained model's): speculation where a step's weight work, not
host overhead, sets its cost.
Engines are built once per part, outside the timed runs (a server keeps its
compiled steps and its policy's measurements); every variant first runs untimed
(compiles), then the variants of a part run in turn `repeats` times (part c:
`spec_repeats`) with the prefix cache emptied before each, and the median run is
reported, so load from other processes on a shared machine hits every variant alike.
Prints claim id, seed value and ours side by
side; writes results/<name>.json and .png.
"""
import functools
import os
import time

from absl import app
from ml_collections import config_flags
import jax
import numpy as np

from experiments import common, hf_peer
import kvjax
from kvjax.cli import bench as cli_bench
from kvjax.engine.engine import Engine
from kvjax.model.params import count_params
from kvjax.server.bench import workloads as bench_workloads
from kvjax.weights.grow import grow

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/serve_bench.py", "experiment config", lock_config=True)


def _to_hf(model: kvjax.Model):
  """The trunk (MTP heads dropped) as an HF LlamaForCausalLM on kvjax's own buffers."""
  trunk = kvjax.Model(model.config.replace(mtp_num_hidden_layers=0),
                      model.params.replace(mtp=()), model.dtype)
  return hf_peer.to_hf_on_device(trunk)


def _hf_static(hf, sessions, batch: int, threads: int):
  """Static batches on `threads` torch threads -> (outputs, wall s).

  A batch is left-padded to its longest prompt and runs to its longest output
  (HF generate's static batching); each request keeps its own length of it.
  """
  import torch

  torch.set_num_threads(threads)
  outs, start = [], time.perf_counter()
  with torch.inference_mode():
    for i in range(0, len(sessions), batch):
      group = sessions[i:i + batch]
      width = max(len(s.turns[0]) for s in group)
      new = max(s.max_new_tokens for s in group)
      ids = torch.zeros((len(group), width), dtype=torch.long)
      mask = torch.zeros_like(ids)
      for j, s in enumerate(group):
        ids[j, width - len(s.turns[0]):] = torch.tensor(s.turns[0])
        mask[j, width - len(s.turns[0]):] = 1
      gen = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)
      outs += [gen[j, width:width + s.max_new_tokens].tolist() for j, s in enumerate(group)]
  return outs, time.perf_counter() - start


def _interleaved(variants: dict, repeats: int) -> dict:
  """name -> the median-wall run of each variant (a callable -> dict with "wall_s").

  An untimed run per variant first (compiles, warms caches); then the variants
  run in turn, `repeats` times (common.interleaved).
  """
  return common.interleaved(variants, repeats).median_results(key=lambda run: run["wall_s"])


def _engines(model, variants: dict) -> dict:
  """name -> Engine(model, **kwargs), built once, outside the timed runs (allocating a
  pool is not serving): each keeps what a running server keeps (compiled steps, a draft
  policy's measurements) from one run to the next."""
  return {name: Engine(model, **kwargs) for name, kwargs in variants.items()}


def _serving(engines: dict, sessions) -> dict:
  """name -> a callable serving `sessions` on that warm engine; its prefix cache is
  emptied first so a repeat does not hit the blocks of the run before."""
  def run(engine):
    for cache in engine.prefix_caches():
      cache.reset()
    return cli_bench.run_workload(engine, sessions)

  return {name: functools.partial(run, engine) for name, engine in engines.items()}


def part_a(model, c):
  hf = _to_hf(model)
  out = {}
  for workload, ratio in (("fixed", 0.0), ("variable", c.hf_range_ratio)):
    sessions = bench_workloads.make_workload(
        "random", vocab_size=model.config.vocab_size, num_requests=c.hf_num_requests,
        input_len=c.hf_input_len, output_len=c.hf_output_len, range_ratio=ratio, seed=c.seed)
    useful = sum(s.max_new_tokens for s in sessions)
    longest = max(len(s.turns[0]) + s.max_new_tokens for s in sessions)
    variants = _serving(_engines(model, {("engine", batch): dict(
        page_size=c.page_size, max_num_seqs=batch,
        max_num_batched_tokens=c.hf_max_num_batched_tokens, max_model_len=longest)
        for batch in c.hf_batches}), sessions)
    # HF at 1 and all torch threads, the faster counts: on shared cores torch's
    # 2-thread runs can stall for tens of seconds, which would flatter the engine.
    for batch in c.hf_batches:
      for threads in sorted({1, os.cpu_count() or 1}):
        variants[("hf", batch, threads)] = functools.partial(
            lambda b, t: dict(zip(("outputs", "wall_s"), _hf_static(hf, sessions, b, t))),
            batch, threads)
    runs = _interleaved(variants, c.repeats)
    rows = {}
    for batch in c.hf_batches:
      by_threads = {key[2]: r for key, r in runs.items() if key[:2] == ("hf", batch)}
      threads = min(by_threads, key=lambda t: by_threads[t]["wall_s"])
      ref, ours = by_threads[threads], runs[("engine", batch)]
      same = np.mean([a[:8] == b[0][:8] for a, b in zip(ref["outputs"], ours["outputs"])])
      rows[str(batch)] = {
          "hf_tokens_per_s": useful / ref["wall_s"], "hf_threads": threads,
          "hf_wall_s_by_threads": {str(t): r["wall_s"] for t, r in by_threads.items()},
          "engine_tokens_per_s": ours["tokens_per_s"],
          "speedup": ours["tokens_per_s"] * ref["wall_s"] / useful,
          "first8_tokens_equal_fraction": float(same), "engine_tpot_s": ours["tpot_s"],
          "engine_ttft_s": ours["ttft_s"],
          "engine_decode_step_s": ours["decode_step_s"]["median"]}
    best_hf = max(r["hf_tokens_per_s"] for r in rows.values())
    best_engine = max(r["engine_tokens_per_s"] for r in rows.values())
    out[workload] = {"range_ratio": ratio, "useful_tokens": useful, "by_batch": rows,
                     "best_speedup": best_engine / best_hf}
  return out


def part_b(model, c):
  sessions = bench_workloads.make_workload(
      "multi-turn-chat", vocab_size=model.config.vocab_size, num_requests=c.chat_num_chats,
      input_len=c.chat_user_len, output_len=c.chat_output_len, num_turns=c.chat_num_turns,
      seed=c.seed)
  max_len = c.chat_num_turns * (c.chat_user_len + c.chat_output_len)
  runs = _interleaved(_serving(_engines(model, {
      name: dict(page_size=c.page_size, max_num_seqs=c.chat_num_chats,
                 max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=max_len,
                 prefix_cache=cache) for name, cache in (("cache", True), ("no_cache", False))}),
      sessions), c.repeats)
  out = {name: {k: run[k] for k in ("turn_ttft_s", "turn_prompt_tokens", "prefix_hit_rate",
                                    "tokens_per_s", "ttft_s")} for name, run in runs.items()}
  last_on = out["cache"]["turn_ttft_s"][-1]
  last_off = out["no_cache"]["turn_ttft_s"][-1]
  out["last_turn_ttft_ratio"] = last_off / last_on
  out["no_cache_last_vs_first_turn_ttft"] = last_off / out["no_cache"]["turn_ttft_s"][0]
  return out


def part_c(model, c):
  out = {}
  for batch in c.spec_batches:
    sessions = bench_workloads.make_workload(
        "random", vocab_size=model.config.vocab_size,
        num_requests=batch * c.spec_requests_per_slot, input_len=c.spec_input_len,
        output_len=c.spec_output_len, seed=c.seed + 1)
    variants = (("plain", None, c.num_draft, c.num_scheduler_steps),
                ("mtp", "mtp", c.num_draft, c.num_scheduler_steps),
                ("mtp_auto", "mtp", "auto", c.num_scheduler_steps),
                ("plain_single_step", None, c.num_draft, 1))
    engines = _engines(model, {
        name: dict(page_size=c.page_size, max_num_seqs=batch,
                   max_num_batched_tokens=c.spec_max_num_batched_tokens,
                   max_model_len=c.spec_input_len + c.spec_output_len, speculative=spec,
                   num_draft=num_draft, num_scheduler_steps=steps)
        for name, spec, num_draft, steps in variants})
    # The adaptive policy may pick any (row bucket, k) program at any step, so its
    # engine compiles them all first, as `kvjax serve` does (Engine.warm_up); the
    # fixed variants' programs are all compiled by the untimed runs.
    engines["mtp_auto"].warm_up()
    runs = common.interleaved(_serving(engines, sessions), c.spec_repeats, warmup=2).median_results(
        key=lambda run: run["wall_s"])
    plain, mtp, single = runs["plain"], runs["mtp"], runs["plain_single_step"]
    auto, policy = runs["mtp_auto"], engines["mtp_auto"].draft_policy
    chosen = [k for k, decode in zip(engines["mtp_auto"].steps.num_draft,
                                     engines["mtp_auto"].steps.decode_only) if decode]
    out[f"batch_{batch}"] = {
        "plain_tokens_per_s": plain["tokens_per_s"], "mtp_tokens_per_s": mtp["tokens_per_s"],
        "speedup": mtp["tokens_per_s"] / plain["tokens_per_s"],
        "auto_tokens_per_s": auto["tokens_per_s"],
        "auto_speedup": auto["tokens_per_s"] / plain["tokens_per_s"],
        "auto_drafts_chosen": {str(k): chosen.count(k) for k in sorted(set(chosen))},
        "auto_estimates": policy.estimates(),
        "auto_greedy_outputs_equal": auto["outputs"] == plain["outputs"],
        "decode_speedup": plain["tpot_s"] / mtp["tpot_s"],
        "acceptance_length": mtp["acceptance_length"],
        "acceptance_rate_per_position": mtp["acceptance_rate_per_position"],
        "plain_tpot_s": plain["tpot_s"], "mtp_tpot_s": mtp["tpot_s"],
        # C9 on this device: one verify-and-draft step over one plain decode step.
        "plain_decode_step_s": plain["decode_step_s"]["median"],
        "mtp_decode_step_s": mtp["decode_step_s"]["median"],
        "verify_step_cost": mtp["decode_step_s"]["median"] / plain["decode_step_s"]["median"],
        "greedy_outputs_equal": plain["outputs"] == mtp["outputs"] == single["outputs"],
        # C13 in the engine: a multi-step device loop vs one dispatch per step.
        "single_step_tokens_per_s": single["tokens_per_s"],
        "multi_step_speedup": plain["tokens_per_s"] / single["tokens_per_s"]}
    # Every engine's step programs stay in jax's caches: over all parts, LLVM ran out
    # of memory maps (vm.max_map_count) compiling batch 32's, and XLA crashed.
    del engines
    jax.clear_caches()
  return out


def _plot(results, path):
  parts = [part for part in "abc" if part in results]
  with common.figure(path, 1, len(parts), figsize=(5 * len(parts), 4.4)) as (fig, axes):
    fig.suptitle(f"{results['model']} ({results['params'] / 1e6:.1f}M params), "
                 f"{results['machine'].split(',')[0]}")
    for part, ax in zip(parts, np.atleast_1d(axes)):
      _DRAW[part](results[part], ax)


def _draw_a(a, ax):
  labels = [f"{w}\nbatch {b}" for w in a for b in a[w]["by_batch"]]
  x = np.arange(len(labels))
  for offset, key, label in ((-0.2, "hf_tokens_per_s", "HF static"),
                             (0.2, "engine_tokens_per_s", "kvjax engine")):
    ax.bar(x + offset, [r[key] for w in a for r in a[w]["by_batch"].values()], 0.4,
           label=label)
  ax.set_xticks(x, labels)
  ax.set(ylabel="useful output tokens/s", title="(a) throughput vs HF static batching")
  ax.legend()


def _draw_b(b, ax):
  turns = np.arange(1, len(b["cache"]["turn_ttft_s"]) + 1)
  for key, label in (("no_cache", "no prefix cache"), ("cache", "prefix cache")):
    ax.plot(turns, np.asarray(b[key]["turn_ttft_s"]) * 1e3, "o-", label=label)
  ax.set(xlabel="turn", ylabel="mean TTFT (ms)", yscale="log",
         title=f"(b) C15 chats: last turn {b['last_turn_ttft_ratio']:.1f}x")
  ax.legend()


def _draw_c(cc, ax):
  names = list(cc)
  x = np.arange(len(names))
  for offset, key, label in ((-0.27, "plain_tokens_per_s", "plain"),
                             (0.0, "mtp_tokens_per_s", "MTP K=2"),
                             (0.27, "auto_tokens_per_s", "MTP auto")):
    ax.bar(x + offset, [cc[n][key] for n in names], 0.27, label=label)
  ax.set_xticks(x, [f"{n}\naccept {cc[n]['acceptance_length']:.2f}" for n in names])
  ax.set(ylabel="output tokens/s", title="(c) MTP speculation")
  ax.legend()


_DRAW = {"a": _draw_a, "b": _draw_b, "c": _draw_c}


def _spec_rows(batch: int, r: dict, first: bool) -> list:
  """Table rows of part (c) at one batch size; the goals apply to the first (batch 1)."""
  return [
      ("C10", f"MTP acceptance length, batch {batch}", "2.39 (goal >= 2.4)" if first else "2.39",
       f"{r['acceptance_length']:.2f}"),
      ("issue", f"MTP speedup tok/s, batch {batch}", ">= 1.5x" if first else "-",
       f"{r['speedup']:.2f}x"),
      ("issue", f"MTP speedup TPOT, batch {batch}", ">= 1.5x" if first else "-",
       f"{r['decode_speedup']:.2f}x"),
      ("issue", f"MTP num_draft='auto' / plain tok/s, batch {batch}", ">= 1.0x",
       f"{r['auto_speedup']:.2f}x"),
      ("C9", f"verify+draft step / decode step, batch {batch}", "~1x",
       f"{r['verify_step_cost']:.2f}x"),
      ("C13", f"engine tok/s, multi-step device loop / a call per step, batch {batch}",
       "+12.5% (CUDA graph, batch 1)", f"{r['multi_step_speedup'] - 1:+.0%}"),
  ]


def _table(results: dict, c) -> list:
  """(claim, what, seed, ours) rows of the parts that ran."""
  rows = []
  if "a" in results:
    rows += [("issue", f"engine / HF static tok/s, {w} lengths, batch {b}", "-",
              f"{r['speedup']:.2f}x") for w, v in results["a"].items()
             for b, r in v["by_batch"].items()]
    rows += [("issue", f"best engine / best HF tok/s, {w} lengths", ">= 3x",
              f"{v['best_speedup']:.2f}x") for w, v in results["a"].items()]
  if "b" in results:
    rows += [("C15", "TTFT turn N / turn 1, no cache", "~10x",
              f"{results['b']['no_cache_last_vs_first_turn_ttft']:.1f}x"),
             ("C15/issue", "turn-N TTFT, no cache / cache", ">= 5x",
              f"{results['b']['last_turn_ttft_ratio']:.1f}x")]
  if "c" in results:
    rows += [row for batch in c.spec_batches
             for row in _spec_rows(batch, results["c"][f"batch_{batch}"],
                                   first=batch == c.spec_batches[0])]
    b1 = results["c"][f"batch_{c.spec_batches[0]}"]
    near10 = min(c.spec_batches[1:] or c.spec_batches, key=lambda b: abs(b - 10))  # C14
    bn = results["c"][f"batch_{near10}"]
    rows.append(("C14", f"TPOT batch {near10} / batch {c.spec_batches[0]} (plain)", "~1x",
                 f"{bn['plain_tpot_s'] / b1['plain_tpot_s']:.2f}x"))
  if c.grow:  # the report lists these beside the default model's rows
    rows = [(claim, f"{what} ({results['model']})", seed, ours) for claim, what, seed, ours in rows]
  return rows


def main(argv):
  del argv
  c = _CONFIG.value
  model = kvjax.load_checkpoint(c.checkpoint or None)
  # EOS off: every request emits exactly its output length, here and in HF.
  cfg, params = model.config, model.params
  if c.grow:
    cfg, params = grow(cfg, params, key=jax.random.PRNGKey(c.seed), **c.grow)
  model = kvjax.Model(cfg.replace(eos_token_id=None), params, model.dtype)
  device = common.describe_device()
  results = {"machine": f"{common.device_label(device)}, {device['os']}", "seed": c.seed,
             "model": model.config.name, "params": count_params(params),
             "config": c.to_dict()}
  for part, run in (("a", part_a), ("b", part_b), ("c", part_c)):
    if part in c.parts:
      results[part] = run(model, c)
      jax.clear_caches()  # see part_c
  results["table"] = common.claim_rows(_table(results, c))
  print(f"serve_bench on {results['machine']}, seed {c.seed}, model {model.config.name} "
        f"({results['params']:,} params)")
  common.print_claims(results["table"], "{claim:<10} {what:<52} {seed:<20} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))


if __name__ == "__main__":
  app.run(main)
