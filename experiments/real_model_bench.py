"""The CPU peers side by side on the real model (issue 27 item 5).

One GGUF file (configs/real_model_bench.py: SmolLM2-135M-Instruct Q4_1; its `gemma3` arg:
Gemma 3 270M Q4_K_M), one set of prompts (chat messages rendered with the checkpoint's own
template, or plain text for a base model without one) encoded once, so every engine gets the
same token ids, on the same machine, in interleaved rounds (experiments/common.py):

(a) batch 1, greedy, `new_tokens` per prompt, EOS ignored: TTFT and decode tok/s
    (1 / mean TPOT, TPOT = (last token - first token) / (tokens - 1)).  kvjax: a warm
    Engine (max_num_seqs 1, no prefix cache: each prompt is prefilled in full, as by
    the peers) per weight dtype.  HF transformers: the file dequantized by transformers' GGUF loader, float32,
    `generate` (min_new_tokens = max_new_tokens).  llama.cpp: llama-cpp-python in its
    own venv, a child process kept for the run (`Llama.generate`, greedy, its cache reset
    before each prompt), at each n_threads; the faster counts.  Greedy agreement: the
    leading tokens each engine shares with kvjax float32, per prompt.
(b) throughput at each concurrency: kvjax's HTTP server (kvjax.server.serve_in_thread,
    one per serve weight dtype, max_num_seqs = the largest concurrency) against
    llama-server with as many slots (-np, -c slots x context, --threads), one wave of
    requests_per_slot x concurrency requests of max_tokens each, streamed through the
    same client (kvjax/server/bench/client.py) in a child process; output tokens/s.  EOS is
    ignored by both (llama-server --ignore-eos; kvjax serves the model without stop ids:
    its server has no ignore_eos), so every answer has max_tokens tokens.  A kvjax round
    that compiled a step program runs again (at most max_tries).
A peer that is not installed is skipped and the run prints the command that installs
it.  Prints the goals (batch 1 >= 1.0x llama.cpp's best; the largest concurrency >= 2x
llama-server) with the CPU model; the machine is shared, so ratios of interleaved
rounds are what to read, not the absolute rates.  Writes results/<name>.json and .png.
"""
import concurrent.futures
import contextlib
import functools
import json
import multiprocessing
import os
import socket
import subprocess
import time

from absl import app
from ml_collections import config_flags
import numpy as np

from experiments import common
import kvjax
from kvjax.cli import bench as cli_bench
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.runtime import serve_steps
from kvjax.server import serve_in_thread
from kvjax.server.bench import client as bench_client
from kvjax.server.bench import workloads as bench_workloads
from kvjax.weights.gguf import gguf_path

INSTALL = "bash experiments/install_cpu_peers.sh {peers_dir}"

# The llama-cpp-python peer, run by its venv's python: one JSON request a line on stdin
# ({"threads", "prompt", "new_tokens"}), one JSON answer a line on stdout.
_LLAMACPP_WORKER = """
import json, sys, time
import llama_cpp
path, n_ctx = sys.argv[1], int(sys.argv[2])
models = {}
print(json.dumps({"version": llama_cpp.__version__,
                  "system_info": llama_cpp.llama_print_system_info().decode()}), flush=True)
for line in sys.stdin:
  req = json.loads(line)
  t = req["threads"]
  if t not in models:
    models[t] = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=t, n_threads_batch=t,
                                seed=0, verbose=False)
  llm = models[t]
  llm.reset()  # a repeat must prefill again, not reuse the last prompt's KV
  start, times, tokens = time.perf_counter(), [], []
  for token in llm.generate(req["prompt"], temp=0.0, top_k=1, repeat_penalty=1.0):
    times.append(time.perf_counter())
    tokens.append(token)
    if len(tokens) == req["new_tokens"]:
      break
  print(json.dumps({"start": start, "times": times, "tokens": tokens}), flush=True)
"""


# -- pure helpers -----------------------------------------------------------------


def find_peers(peers_dir: str) -> dict:
  """install_cpu_peers.sh's outputs under peers_dir -> {"llamacpp_python", "llama_server"}:
  each an executable path, or None where it is missing."""
  python = os.path.join(peers_dir, "llamacpp-venv", "bin", "python")
  server = os.path.join(peers_dir, "llama-server")
  return {"llamacpp_python": python if os.access(python, os.X_OK) else None,
          "llama_server": server if os.access(server, os.X_OK) else None}


def token_timing(start: float, times) -> tuple:
  """perf_counter at the request and at each new token -> (TTFT s, TPOT s); TPOT is
  (last - first) / (tokens - 1), None for a single token."""
  if not times:
    raise ValueError("no tokens were timed")
  tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
  return times[0] - start, tpot


def batch1_summary(timings) -> dict:
  """[(TTFT, TPOT)] per prompt -> mean TTFT, mean TPOT and decode tok/s = 1 / mean TPOT."""
  ttft = float(np.mean([t for t, _ in timings]))
  tpot = float(np.mean([p for _, p in timings]))
  return {"ttft_s": ttft, "tpot_s": tpot, "decode_tokens_per_s": 1.0 / tpot}


def shared_prefix(a, b) -> int:
  """How many leading tokens two sequences share."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def llama_server_argv(binary: str, model_path: str, slots: int, slot_ctx: int, threads: int,
                      port: int) -> list:
  """llama-server serving `slots` requests at once, each with slot_ctx tokens of context."""
  return [binary, "-m", model_path, "-np", str(slots), "-c", str(slots * slot_ctx),
          "--threads", str(threads), "--threads-batch", str(threads), "--ignore-eos",
          "--host", "127.0.0.1", "--port", str(port)]


# -- the peers ----------------------------------------------------------------------


class _LlamaCpp:
  """llama-cpp-python in its venv, a child process kept for the whole run."""

  def __init__(self, python: str, model_path: str, n_ctx: int):
    self._proc = subprocess.Popen([python, "-c", _LLAMACPP_WORKER, model_path, str(n_ctx)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.info = self._read()

  def _read(self) -> dict:
    line = self._proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the llama-cpp-python worker exited ({self._proc.wait()})")
    return json.loads(line)

  def run(self, prompts, new_tokens: int, threads: int) -> dict:
    timings, tokens = [], []
    for prompt in prompts:
      self._proc.stdin.write(json.dumps(dict(threads=threads, prompt=prompt,
                                             new_tokens=new_tokens)) + "\n")
      self._proc.stdin.flush()
      answer = self._read()
      timings.append(token_timing(answer["start"], answer["times"]))
      tokens.append(answer["tokens"])
    return {**batch1_summary(timings), "tokens": tokens}

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait(30)


class _TokenClock:
  """A transformers streamer that notes when each new token arrives (the first put is
  the prompt)."""

  def __init__(self):
    self.times, self._prompt_seen = [], False

  def put(self, value) -> None:
    if self._prompt_seen:
      self.times.append(time.perf_counter())
    self._prompt_seen = True

  def end(self) -> None:
    pass


def _transformers_run(hf, prompts, new_tokens: int, threads: int) -> dict:
  import torch

  torch.set_num_threads(threads)
  timings, tokens = [], []
  with torch.inference_mode():
    for prompt in prompts:
      clock, start = _TokenClock(), time.perf_counter()
      out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)),
                                                                          dtype=torch.long),
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        pad_token_id=0, streamer=clock)
      timings.append(token_timing(start, clock.times))
      tokens.append(out[0, len(prompt):].tolist())
  return {**batch1_summary(timings), "tokens": tokens}


def _load_transformers(model_path: str):
  import torch
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
      dtype=torch.float32).eval()


def _kvjax_run(engine, prompts, new_tokens: int) -> dict:
  run = cli_bench.run_workload(engine, [bench_workloads.Session([p], new_tokens) for p in prompts])
  return {"ttft_s": run["ttft_s"], "tpot_s": run["tpot_s"],
          "decode_tokens_per_s": 1.0 / run["tpot_s"], "tokens": [o[0] for o in run["outputs"]]}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def _llama_server(argv: list, port: int, timeout_s: float = 300.0):
  """A running llama-server -> its URL; stopped on exit."""
  proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  try:
    common.wait_healthy(url, proc, timeout_s, f"llama-server ({' '.join(argv)})")
    yield url
  finally:
    proc.terminate()
    proc.wait(30)


class _NoStopTokenizer:
  """The model's tokenizer with no stop ids: kvjax's server stops at the tokenizer's EOS
  ids and has no ignore_eos, so this is how its answers run to max_tokens."""

  eos_ids = ()

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  def __getattr__(self, name):
    return getattr(self._tokenizer, name)


# -- the parts ----------------------------------------------------------------------


def _without_compiles(fn, max_tries: int, tally: dict):
  """fn() until a call compiles no kvjax step program (at most max_tries calls)."""
  for tries in range(1, max_tries + 1):
    before = serve_steps.num_compiled()
    result = fn()
    if serve_steps.num_compiled() == before:
      break
  tally["rerun"] += tries - 1
  return result


def _bench(client, sessions, concurrency: int, url: str) -> dict:
  """One wave of `sessions` against the server at `url` from the client process."""
  return client.submit(bench_client.run_benchmark, url, sessions, max_concurrency=concurrency,
                       metrics_interval_s=None).result()["summary"]


def _as_prompt(tokenizer, text: str) -> str:
  """One user message in the checkpoint's chat template; a base model (no template, e.g.
  Gemma 3 270M) continues the text itself."""
  if tokenizer.chat_template is None:
    return text
  return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def part_a(models: dict, prompts, c, model_path: str, llamacpp) -> dict:
  longest = max(map(len, prompts)) + c.new_tokens
  runs = {}
  for dtype, model in models.items():
    # No prefix cache: the prompts share the template's system turn, and every peer here
    # prefills each prompt in full.
    engine = Engine(model, max_num_seqs=1, max_model_len=longest, prefix_cache=False,
                    max_num_batched_tokens=max(c.max_num_batched_tokens, longest))
    runs[f"kvjax {dtype}"] = functools.partial(_kvjax_run, engine, prompts, c.new_tokens)
  if c.transformers:
    hf = _load_transformers(model_path)
    runs["transformers float32"] = functools.partial(_transformers_run, hf, prompts,
                                                     c.new_tokens, c.hf_threads)
  if llamacpp is not None:
    for threads in c.llamacpp_threads:
      runs[f"llama.cpp {threads} threads"] = functools.partial(
          llamacpp.run, prompts, c.new_tokens, threads)
  timings = common.interleaved(runs, c.repeats)
  median = timings.median_results(key=lambda r: r["tpot_s"])
  reference = median[f"kvjax {c.weight_dtypes[0]}"]["tokens"]
  rows = {name: {**{k: v for k, v in r.items() if k != "tokens"},
                 "rounds_decode_tokens_per_s": [x["decode_tokens_per_s"]
                                                for x in timings.results[name]],
                 "shared_prefix_with_kvjax": [shared_prefix(a, b)
                                              for a, b in zip(r["tokens"], reference)],
                 "tokens": r["tokens"]} for name, r in median.items()}
  return {"prompt_tokens": [len(p) for p in prompts], "new_tokens": c.new_tokens,
          "engines": rows}


def part_b(models: dict, prompts, c, model_path: str, server_binary) -> dict:
  widest = max(c.concurrency)
  slot_ctx = int(2 ** np.ceil(np.log2(max(map(len, prompts)) + c.max_tokens + 1)))
  config = EngineConfig(max_num_seqs=widest, max_num_batched_tokens=c.max_num_batched_tokens,
                        max_model_len=slot_ctx)
  tally, out = {"rerun": 0}, {}
  spawn = multiprocessing.get_context("spawn")  # the client in a fresh interpreter
  with contextlib.ExitStack() as stack:
    client = stack.enter_context(concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn))
    servers = {}
    for dtype in c.serve_weight_dtypes:
      model = models[dtype]
      served = kvjax.Model(model.config, model.params, model.dtype,
                           _NoStopTokenizer(model.tokenizer))
      servers[f"kvjax {dtype}"] = stack.enter_context(serve_in_thread(served, config)).url
    for conc in c.concurrency:
      sessions = [bench_workloads.Session([prompts[i % len(prompts)]], c.max_tokens)
                  for i in range(conc * c.requests_per_slot)]
      bench = functools.partial(_bench, client, sessions, conc)
      runs = {name: functools.partial(_without_compiles, functools.partial(bench, url),
                                      c.max_tries, tally) for name, url in servers.items()}
      if server_binary is not None:
        port = _free_port()
        argv = llama_server_argv(server_binary, model_path, conc, slot_ctx, c.server_threads,
                                 port)
        runs[f"llama-server -np {conc}"] = functools.partial(
            bench, stack.enter_context(_llama_server(argv, port)))
      timings = common.interleaved(runs, c.repeats)
      median = timings.median_results(key=lambda r: r["output_throughput"])
      out[str(conc)] = {name: {
          "output_tokens_per_s": r["output_throughput"], "ttft_mean_s": r["ttft"]["mean"],
          "tpot_mean_s": r["tpot"]["mean"], "completed": r["completed"], "failed": r["failed"],
          "output_tokens": r["total_output_tokens"],
          "every_answer_max_tokens": r["total_output_tokens"] == len(sessions) * c.max_tokens,
          "rounds_output_tokens_per_s": [x["output_throughput"] for x in timings.results[name]]}
          for name, r in median.items()}
  return {"slot_context": slot_ctx, "requests": {str(n): n * c.requests_per_slot
                                                 for n in c.concurrency},
          "kvjax_rounds_rerun_for_compiles": tally["rerun"], "by_concurrency": out}


# -- the report -----------------------------------------------------------------------


def _best(rows: dict, prefix: str, key: str):
  """(name, value) of the row named prefix... with the largest key; (None, None) if none."""
  named = {n: r[key] for n, r in rows.items() if n.startswith(prefix)}
  if not named:
    return None, None
  name = max(named, key=named.get)
  return name, named[name]


def _table(results: dict, c) -> list:
  engines = results["a"]["engines"]
  rows = [("issue 27", f"batch-1 decode tok/s, TTFT ms: {name}", "-",
           f"{r['decode_tokens_per_s']:.1f}, {r['ttft_s'] * 1e3:.0f}")
          for name, r in engines.items()]
  ours, ours_rate = _best(engines, "kvjax", "decode_tokens_per_s")
  peer, peer_rate = _best(engines, "llama.cpp", "decode_tokens_per_s")
  if peer is not None:
    rows.append(("issue 27", f"batch-1 decode, best kvjax ({ours}) / best llama.cpp ({peer})",
                 ">= 1.0x", f"{ours_rate / peer_rate:.2f}x"))
  for dtype in ("int8", "int4"):
    if f"kvjax {dtype}" in engines and "kvjax float32" in engines:
      ratio = (engines[f"kvjax {dtype}"]["decode_tokens_per_s"] /
               engines["kvjax float32"]["decode_tokens_per_s"])
      rows.append(("C12", f"{results['model']} batch-1 decode tok/s, {dtype} / float32 "
                          "weights (kvjax)", "faster", f"{ratio:.2f}x"))
  widest = str(max(c.concurrency))
  for conc, by_name in results.get("b", {}).get("by_concurrency", {}).items():
    rows += [("issue 27", f"{conc} concurrent: output tok/s, TTFT ms: {name}", "-",
              f"{r['output_tokens_per_s']:.0f}, {r['ttft_mean_s'] * 1e3:.0f}")
             for name, r in by_name.items()]
    ours, ours_rate = _best(by_name, "kvjax", "output_tokens_per_s")
    peer, peer_rate = _best(by_name, "llama-server", "output_tokens_per_s")
    if peer is not None:
      rows.append(("issue 27", f"{conc} concurrent: best kvjax server ({ours}) / {peer}",
                   ">= 2x" if conc == widest else "-", f"{ours_rate / peer_rate:.2f}x"))
  return rows


def _plot(results, path):
  a = results["a"]["engines"]
  b = results.get("b", {}).get("by_concurrency", {})  # none: written after part (a)
  with common.figure(path, 1, 2, figsize=(13, 4.6)) as (fig, axes):
    fig.suptitle(f"{results['model']} ({os.path.basename(results['gguf'])}), "
                 f"{results['machine'].split(',')[0]}, shared")
    names = list(a)
    axes[0].bar(range(len(names)), [a[n]["decode_tokens_per_s"] for n in names])
    axes[0].set_xticks(range(len(names)), [f"{n}\nTTFT {a[n]['ttft_s'] * 1e3:.0f} ms"
                                           for n in names], rotation=30, fontsize=7)
    axes[0].set(ylabel="decode tokens/s", title="(a) batch 1, greedy")
    servers = sorted({n.split(" -np")[0] for by in b.values() for n in by})
    x, width = np.arange(len(b)), 0.8 / max(len(servers), 1)
    for i, server in enumerate(servers):
      rates = [next((r["output_tokens_per_s"] for n, r in by.items()
                     if n.split(" -np")[0] == server), 0.0) for by in b.values()]
      axes[1].bar(x + (i - (len(servers) - 1) / 2) * width, rates, width, label=server)
    axes[1].set_xticks(x, [f"{n} concurrent" for n in b])
    axes[1].set(ylabel="output tokens/s", title="(b) served, same client, EOS ignored")
    if b:
      axes[1].legend(fontsize=8)


def main(argv):
  del argv
  c = _CONFIG.value
  model_path = gguf_path(c.checkpoint)
  if model_path is None:
    raise ValueError(f"checkpoint {c.checkpoint!r} is not a GGUF file or GGUF model name")
  peers = find_peers(c.peers_dir)
  missing = [name for name, path in peers.items() if path is None]
  if missing:
    print(f"peers missing under {c.peers_dir!r}: {', '.join(missing)}; running without them. "
          f"Install: {INSTALL.format(peers_dir=c.peers_dir)}")
  device = common.describe_device()
  load_before = os.getloadavg()
  models = {}
  for dtype in dict.fromkeys(c.weight_dtypes + c.serve_weight_dtypes):
    loaded = kvjax.load_checkpoint(model_path, weight_dtype=None if dtype == "float32" else dtype)
    # EOS off: every answer has its full length, as the peers' (min_new_tokens, ignore-eos).
    models[dtype] = kvjax.Model(loaded.config.replace(eos_token_id=None), loaded.params,
                                loaded.dtype, loaded.tokenizer)
  tokenizer = models[c.weight_dtypes[0]].tokenizer
  prompts = [tokenizer.encode(_as_prompt(tokenizer, p)) for p in c.prompts]
  llamacpp = None
  if peers["llamacpp_python"] is not None:
    llamacpp = _LlamaCpp(peers["llamacpp_python"], model_path,
                         max(map(len, prompts)) + c.new_tokens + 1)
  try:
    results = {"machine": f"{common.device_label(device)}, {device['os']}", "device": device,
               "shared_machine": "2 cores shared with other engineers' jobs: rates are noisy, "
                                 "read the ratios of interleaved rounds",
               "model": models[c.weight_dtypes[0]].config.name, "gguf": model_path,
               "config": c.to_dict(), "peers": peers,
               "llama_cpp_python": llamacpp.info if llamacpp else None}
    start = time.perf_counter()
    results["a"] = part_a({d: models[d] for d in c.weight_dtypes}, prompts, c, model_path,
                          llamacpp)
  finally:
    if llamacpp is not None:
      llamacpp.close()
  # Part (a) kept now: on busy cores part (b) (a server's compilations) can take as long.
  results["table"] = common.claim_rows(_table(results, c))
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))
  # Looked up again: part (a) takes minutes, and a peer build may finish meanwhile.
  peers["llama_server"] = find_peers(c.peers_dir)["llama_server"]
  results["b"] = part_b(models, prompts, c, model_path, peers["llama_server"])
  results["wall_s"] = time.perf_counter() - start
  results["load_average_before_after"] = [load_before, os.getloadavg()]
  results["table"] = common.claim_rows(_table(results, c))
  print(f"real_model_bench on {results['machine']} ({device['cpu_count']} cores, shared: "
        f"noisy), {results['model']}, {os.path.basename(model_path)}; goals: batch-1 decode "
        f">= 1.0x llama.cpp's best, {max(c.concurrency)} concurrent >= 2x llama-server")
  common.print_claims(results["table"], "{claim:<9} {what:<78} {seed:<8} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))


if __name__ == "__main__":
  # Defined here, not at import: tests import this module beside other launchers,
  # and absl allows one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/real_model_bench.py", "experiment config", lock_config=True)
  app.run(main)
