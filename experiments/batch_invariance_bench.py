"""What batch-invariant decoding costs (issue 54 item 2; goal: <= 1.3x plain decode).

Decode tokens/s of the default model (or --checkpoint's) through kvjax.Engine with and
without EngineConfig(batch_invariant=True), at batch 1 and 8: each round adds `batch` fresh
32-token prompts, steps until every request has its first token (prefill, untimed),
then times the steps that decode the remaining tokens.  Medians of interleaved rounds
(common.interleaved; the first round, which compiles, is left out).  Records the CPU's
lscpu flags and the load average before and after: other processes share the cores.
Writes results/batch_invariance_bench.json (the default model) or
results/batch_invariance_bench_<checkpoint>.json.

  python experiments/batch_invariance_bench.py [--checkpoint smollm2-135m-instruct]
      [--rounds 3] [--new-tokens 64]
"""
import argparse
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import common  # pylint: disable=g-import-not-at-top,wrong-import-position


def decode_round(engine, batch: int, new_tokens: int, rng) -> float:
  """Decode tokens/s of one round of `batch` fresh requests."""
  vocab = engine.model_config.vocab_size
  for _ in range(batch):
    engine.add_request(rng.integers(3, vocab - 1, 32).tolist(), new_tokens, ignore_eos=True)
  return common.decode_tokens_per_s(engine, new_tokens)


def lscpu_flags() -> str:
  out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
  return next((line.split(":", 1)[1].strip() for line in out.splitlines()
               if line.startswith("Flags")), "")


def plot(results: dict, path: str) -> None:
  """Decode tokens/s with and without the flag, per batch (bars), the cost above each."""
  batches = sorted(results["tokens_per_s"], key=int)
  with common.figure(path, figsize=(5, 3.5)) as (_, ax):
    for i, name in enumerate(("plain", "batch_invariant")):
      rates = [results["tokens_per_s"][b][name] for b in batches]
      ax.bar([j + 0.4 * i for j in range(len(batches))], rates, 0.4, label=name)
    for j, b in enumerate(batches):
      top = max(results["tokens_per_s"][b]["plain"], results["tokens_per_s"][b]["batch_invariant"])
      ax.text(j + 0.2, top, f"{results['cost'][b]:.2f}x", ha="center", va="bottom")
    ax.set_xticks([j + 0.2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"{results['model']}, batch-invariant vs plain")
    ax.legend()


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", default=None,
                      help="what kvjax.load_checkpoint takes (default: the built-in model)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--out", default="results")
  args = parser.parse_args(argv)
  import kvjax  # pylint: disable=g-import-not-at-top

  model = kvjax.load_checkpoint(args.checkpoint)
  engines = {flag: kvjax.Engine(model, max_num_seqs=8, max_model_len=256,
                                prefix_cache=False, batch_invariant=flag)
             for flag in (False, True)}
  rng = np.random.default_rng(0)
  results = dict(model=model.config.name, checkpoint=args.checkpoint,
                 device=common.describe_device(), lscpu_flags=lscpu_flags(),
                 load_before=os.getloadavg(), rounds=args.rounds,
                 new_tokens=args.new_tokens, tokens_per_s={}, cost={})
  for batch in (1, 8):
    runs = {name: (lambda flag=flag: decode_round(engines[flag], batch, args.new_tokens, rng))
            for name, flag in (("plain", False), ("batch_invariant", True))}
    timings = common.interleaved(runs, args.rounds)
    rates = {name: common.median(values) for name, values in timings.results.items()}
    results["tokens_per_s"][batch] = dict(rates, rounds=timings.results)
    results["cost"][batch] = rates["plain"] / rates["batch_invariant"]
    print(f"batch {batch}: plain {rates['plain']:.1f} tok/s, batch_invariant "
          f"{rates['batch_invariant']:.1f} tok/s, cost {results['cost'][batch]:.2f}x "
          f"(goal <= 1.3x)", flush=True)
  results["load_after"] = os.getloadavg()
  name = "batch_invariance_bench" + (f"_{args.checkpoint}" if args.checkpoint else "")
  common.write_results(args.out, name, results,
                       plot=lambda path: plot(results, path))


if __name__ == "__main__":
  main()
