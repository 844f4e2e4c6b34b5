"""What serving LoRA adapters costs (issue 54 item 3; goal: a batch mixing 4 adapters
decodes >= 0.8x the base model's tokens/s at batch 8).

Decode tokens/s through kvjax.Engine at batch 8, three ways on one model: the base model
in an engine without adapter slots, the same base requests in an engine with 4 slots
loaded (what the slots cost a request that names none), and 8 requests spread over the 4
adapters (2 each: one step gathers 4 adapters' rows).  The adapters are random rank-8
PEFT files over every target (q/k/v/o, gate/up/down) written for the run.  Each round
adds 8 fresh 32-token prompts, steps until every request has its first token (prefill,
untimed), then times the decode steps.  Medians of interleaved rounds (common.interleaved;
the compiling first round left out).  Records the CPU flags and the load average before
and after.  Writes results/lora_bench.json (+ .png).

  python experiments/lora_bench.py [--checkpoint smollm2-135m-instruct] [--rounds 3]
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import common  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH, NUM_ADAPTERS, RANK = 8, 4, 8
GOAL = 0.8


def write_adapter(directory: str, model, seed: int) -> None:
  """A random rank-RANK PEFT LoRA adapter over every target module of `model`."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  from kvjax.lora.peft import TARGETS  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  tensors = {}
  for layer, block in enumerate(model.params.blocks):
    for module, (field, name, num_in) in TARGETS.items():
      shape = getattr(block.attn if field else block, name).shape
      size_in, size_out = int(np.prod(shape[:num_in])), int(np.prod(shape[num_in:]))
      part = "self_attn" if field else "mlp"
      key = f"base_model.model.model.layers.{layer}.{part}.{module}.lora_"
      tensors[key + "A.weight"] = rng.normal(0, 0.02, (RANK, size_in)).astype(np.float32)
      tensors[key + "B.weight"] = rng.normal(0, 0.02, (size_out, RANK)).astype(np.float32)
  save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
  with open(os.path.join(directory, "adapter_config.json"), "w") as f:
    json.dump(dict(peft_type="LORA", r=RANK, lora_alpha=2 * RANK,
                   target_modules=sorted(TARGETS)), f)


def decode_round(engine, loras, new_tokens: int, rng) -> float:
  """Decode tokens/s of one round: a fresh request per entry of `loras` (None: base)."""
  vocab = engine.model_config.vocab_size
  for lora in loras:
    engine.add_request(rng.integers(3, vocab - 1, 32).tolist(), new_tokens, ignore_eos=True,
                       lora=lora)
  return common.decode_tokens_per_s(engine, new_tokens)


def plot(results: dict, path: str) -> None:
  names = list(results["tokens_per_s"])
  rates = [results["tokens_per_s"][n] for n in names]
  with common.figure(path, figsize=(6, 3.5)) as (_, ax):
    ax.bar(range(len(names)), rates)
    for i, n in enumerate(names):
      ax.text(i, rates[i], f"{results['vs_base'][n]:.2f}x", ha="center", va="bottom")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("decode tokens/s at batch 8 (median)")
    ax.set_title(f"{results['checkpoint']}: LoRA rows vs the base model")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", default=None,
                      help="a kvjax checkpoint name or path (default: the built-in model)")
  parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
  parser.add_argument("--new-tokens", type=int, default=64,
                      help="decoded tokens per request (default 64)")
  parser.add_argument("--out", default="results", help="results folder (default results/)")
  args = parser.parse_args(argv)
  import kvjax  # pylint: disable=g-import-not-at-top

  model = kvjax.load_checkpoint(args.checkpoint)
  options = dict(max_num_seqs=BATCH, max_model_len=256, prefix_cache=False)
  base = kvjax.Engine(model, **options)
  slotted = kvjax.Engine(model, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, **options)
  names = [f"adapter{i}" for i in range(NUM_ADAPTERS)]
  with tempfile.TemporaryDirectory() as tmp:
    for i, name in enumerate(names):
      os.makedirs(os.path.join(tmp, name))
      write_adapter(os.path.join(tmp, name), model, seed=i)
      slotted.load_adapter(name, os.path.join(tmp, name))
  rng = np.random.default_rng(0)
  mixed = [names[i % NUM_ADAPTERS] for i in range(BATCH)]
  runs = {"base": lambda: decode_round(base, [None] * BATCH, args.new_tokens, rng),
          "base_in_slotted_engine": lambda: decode_round(slotted, [None] * BATCH,
                                                         args.new_tokens, rng),
          "4_adapters_mixed": lambda: decode_round(slotted, mixed, args.new_tokens, rng)}
  results = dict(issue="54 item 3", checkpoint=args.checkpoint or "default",
                 device=common.describe_device(), load_before=os.getloadavg(),
                 rounds=args.rounds, new_tokens=args.new_tokens, batch=BATCH, rank=RANK)
  timings = common.interleaved(runs, args.rounds)
  rates = {name: common.median(values) for name, values in timings.results.items()}
  results["tokens_per_s"] = rates
  results["rounds_tokens_per_s"] = timings.results
  results["vs_base"] = {name: rate / rates["base"] for name, rate in rates.items()}
  results["load_after"] = os.getloadavg()
  for name, rate in rates.items():
    print(f"{name}: {rate:.1f} tok/s, {results['vs_base'][name]:.2f}x base", flush=True)
  print(f"issue 54 goal: 4 adapters mixed >= {GOAL}x base at batch {BATCH}; ours "
        f"{results['vs_base']['4_adapters_mixed']:.2f}x", flush=True)
  name = "lora_bench" + ("" if args.checkpoint is None else f"_{args.checkpoint}")
  common.write_results(args.out, name, results, plot=lambda path: plot(results, path))


if __name__ == "__main__":
  main()
