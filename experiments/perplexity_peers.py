"""Perplexity of one text through kvjax and its peers, on the same GGUF file and token ids.

For each checkpoint of the config (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M): the
stdlib text of `kvjax eval perplexity` (kvjax/eval/text_set.py), tokenized once by kvjax,
cut into segments of `context` + 1 ids (kvjax/eval/perplexity.py `segments`), and every
id after a segment's first scored by
- kvjax: float32 weights (the file's blocks dequantized) through the paged KV cache, prefill
  chunks of `chunk` columns, as `kvjax eval perplexity` runs (Gemma 3's local layers under
  their 512-token window: a context past 512 makes them bind);
- HF transformers: the same file dequantized by its own GGUF loader, float32, one forward
  per segment;
- llama.cpp: llama-cpp-python in its own venv (experiments/install_cpu_peers.sh), every
  position's logits of one `eval` per segment.
Reported per engine: nats/token and perplexity; against kvjax: the perplexity's relative
difference and the largest per-token |log p| difference (the float32 noise of two
implementations; llama.cpp also quantizes its activations to 8 bits in its dot products).
Goals (issue 50): kvjax's Gemma 3 perplexity within 0.2% of transformers', within 1% of
llama.cpp's.  Writes results/<name>.json and .png.
"""
import json
import os
import subprocess
import time

from absl import app
from ml_collections import config_flags
import numpy as np

from experiments import common
from experiments.real_model_bench import find_peers
import kvjax
from kvjax.eval import perplexity, text_set
from kvjax.weights.gguf import gguf_path

GOALS = {"transformers": 0.2, "llama.cpp": 1.0}  # % perplexity difference, kvjax vs peer

# The llama-cpp-python peer, run by its venv's python: one JSON list of token ids a line on
# stdin; one JSON answer a line: each next id's logit and the float64 logsumexp of its row.
_LLAMACPP_WORKER = """
import json, sys
import llama_cpp
import numpy as np
path, n_ctx, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                      logits_all=True, seed=0, verbose=False)
print(json.dumps({"version": llama_cpp.__version__}), flush=True)
for line in sys.stdin:
  ids = json.loads(line)
  llm.reset()
  llm.eval(ids[:-1])
  targets, lse = [], []
  for start in range(0, len(ids) - 1, 64):  # float64 rows a few at a time: V is 262k
    rows = np.asarray(llm.scores[start:min(start + 64, len(ids) - 1)], np.float64)
    peak = rows.max(axis=1)
    lse += (peak + np.log(np.exp(rows - peak[:, None]).sum(axis=1))).tolist()
    targets += rows[np.arange(len(rows)), ids[start + 1:start + 1 + len(rows)]].tolist()
  print(json.dumps({"target_logits": targets, "logsumexp": lse}), flush=True)
"""


def target_logp(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """logits [T, V], targets [T] -> log p(targets) [T] in float64."""
  logits = np.asarray(logits, np.float64)
  peak = logits.max(axis=1)
  lse = peak + np.log(np.exp(logits - peak[:, None]).sum(axis=1))
  return logits[np.arange(len(targets)), targets] - lse


def summary(logp: np.ndarray) -> dict:
  """log p of every scored id [S, C] -> nats/token, perplexity, token count."""
  nats = -float(np.mean(logp, dtype=np.float64))
  return {"nats_per_token": nats, "perplexity": float(np.exp(nats)), "tokens": int(logp.size)}


def _transformers_logp(model_path: str, windows: np.ndarray, threads: int) -> np.ndarray:
  import torch
  import transformers

  torch.set_num_threads(threads)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
      dtype=torch.float32).eval()
  out = []
  with torch.inference_mode():
    for window in windows:
      logits = hf(torch.tensor(window[None, :-1], dtype=torch.long)).logits[0]
      out.append(target_logp(logits.numpy(), window[1:]))
  return np.stack(out)


def _llamacpp_logp(python: str, model_path: str, windows: np.ndarray,
                   threads: int) -> tuple[np.ndarray, str]:
  proc = subprocess.Popen([python, "-c", _LLAMACPP_WORKER, model_path,
                           str(windows.shape[1]), str(threads)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  def read() -> dict:
    line = proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the llama-cpp-python worker ({python}) exited ({proc.wait()})")
    return json.loads(line)

  try:
    version = read()["version"]
    out = []
    for window in windows:
      proc.stdin.write(json.dumps(window.tolist()) + "\n")
      proc.stdin.flush()
      answer = read()
      out.append(np.asarray(answer["target_logits"]) - np.asarray(answer["logsumexp"]))
    return np.stack(out), version
  finally:
    proc.stdin.close()
    proc.wait(60)


def _checkpoint(name: str, c, peers: dict) -> dict:
  model_path = gguf_path(name)
  if model_path is None:
    raise ValueError(f"checkpoint {name!r} is not a GGUF file or GGUF model name")
  model = kvjax.load_checkpoint(model_path)
  ids = text_set.text_ids(model.tokenizer)
  windows = perplexity.segments(ids, c.context)[:c.max_segments]  # [S, C + 1]
  logp, seconds = {}, {}
  began = time.perf_counter()
  logp["kvjax"] = perplexity.score_segments(model, windows, chunk=c.chunk,
                                            batch_size=c.batch_size).astype(np.float64)
  seconds["kvjax"] = time.perf_counter() - began
  info = {}
  if c.transformers:
    began = time.perf_counter()
    logp["transformers"] = _transformers_logp(model_path, windows, c.threads)
    seconds["transformers"] = time.perf_counter() - began
  if peers["llamacpp_python"] is not None:
    began = time.perf_counter()
    logp["llama.cpp"], info["llama_cpp_python"] = _llamacpp_logp(
        peers["llamacpp_python"], model_path, windows, c.threads)
    seconds["llama.cpp"] = time.perf_counter() - began
  engines = {engine: {**summary(values), "seconds": seconds[engine]}
             for engine, values in logp.items()}
  for engine, row in engines.items():
    if engine != "kvjax":
      row["kvjax_vs_this_percent"] = 100.0 * (engines["kvjax"]["perplexity"] /
                                              row["perplexity"] - 1.0)
      row["max_abs_logp_difference"] = float(np.max(np.abs(logp[engine] - logp["kvjax"])))
  return {"model": model.config.name, "gguf": model_path, "segments": int(len(windows)),
          "context": c.context, "engines": engines, **info}


def _table(results: dict) -> list:
  rows = []
  for name, r in results["checkpoints"].items():
    for engine, row in r["engines"].items():
      rows.append(("issue 50", f"{name} perplexity ({r['engines']['kvjax']['tokens']} "
                               f"tokens, context {r['context']}): {engine}", "-",
                   f"{row['perplexity']:.5f}"))
      if engine in GOALS:
        rows.append(("issue 50", f"{name}: kvjax / {engine} perplexity - 1 (largest "
                                 f"per-token |log p| difference "
                                 f"{row['max_abs_logp_difference']:.2g})",
                     f"within {GOALS[engine]}%", f"{row['kvjax_vs_this_percent']:+.3f}%"))
  return rows


def _plot(results, path):
  checkpoints = results["checkpoints"]
  with common.figure(path, 1, len(checkpoints), figsize=(5.5 * len(checkpoints), 4),
                     squeeze=False) as (fig, axes):
    fig.suptitle(f"same ids, same GGUF file, {results['machine'].split(',')[0]}", fontsize=10)
    for ax, (name, r) in zip(axes[0], checkpoints.items()):
      engines = list(r["engines"])
      values = [r["engines"][e]["perplexity"] for e in engines]
      ax.bar(range(len(engines)), values)
      ax.set_xticks(range(len(engines)), engines)
      ax.set_ylim(min(values) * 0.99, max(values) * 1.005)
      ax.set(ylabel="perplexity", title=f"{name}, {r['engines']['kvjax']['tokens']} tokens")
      for i, v in enumerate(values):
        ax.annotate(f"{v:.4f}", (i, v), ha="center", va="bottom", fontsize=8)


def main(argv):
  del argv
  c = _CONFIG.value
  peers = find_peers(c.peers_dir)
  if peers["llamacpp_python"] is None:
    print(f"llama-cpp-python is missing under {c.peers_dir!r}; running without it. Install: "
          f"bash experiments/install_cpu_peers.sh {c.peers_dir}")
  device = common.describe_device()
  results = {"machine": f"{common.device_label(device)}, {device['os']}", "device": device,
             "config": c.to_dict(), "checkpoints": {}}
  for name in c.checkpoints:
    results["checkpoints"][name] = _checkpoint(name, c, peers)
  results["table"] = common.claim_rows(_table(results))
  print(f"perplexity_peers on {results['machine']}; goals: kvjax within "
        f"{GOALS['transformers']}% of transformers, {GOALS['llama.cpp']}% of llama.cpp")
  common.print_claims(results["table"], "{claim:<9} {what:<100} {seed:<12} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=lambda p: _plot(results, p))


if __name__ == "__main__":
  # Defined here, not at import: tests import this module beside other launchers,
  # and absl allows one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/perplexity_peers.py", "experiment config", lock_config=True)
  app.run(main)
