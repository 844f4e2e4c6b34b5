"""guidellm against `python -m kvjax serve` (issue 32): what vLLM's own benchmark tool
sees of kvjax on a real model.

guidellm is a peer, never a kvjax dependency: it is installed into its own venv
(`config.venv`, made on first use).  It needs a Hugging Face tokenizer to size its
synthetic prompts; the experiment writes the served GGUF model's tokenizer (the one kvjax
builds from the GGUF metadata) as tokenizer.json + tokenizer_config.json for it.  One
server (`config.serve_args`, full warm-up) answers one guidellm run per entry of
`config.streams` (its concurrent profile: that many requests in flight), each run
`config.requests` chat requests of synthetic text asking `config.output_tokens` tokens;
guidellm streams them with `ignore_eos`, `max_completion_tokens` and
`stream_options.continuous_usage_stats`.  Checked and reported: errored requests, every
request's output tokens (guidellm's count from the usage) against the asked number and
against the server's own `kvjax:generation_tokens_total`, tokens per stream iteration
(1 when every token arrives in its own chunk), throughput, TTFT, ITL and TPOT as guidellm
defines them.  Prints the issue's claims, the goal and ours; writes results/<name>.json
and .png.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app
from ml_collections import config_flags
import httpx

from experiments import common
from tests.gateway_servers import ServeProcess

_GENERATED = re.compile(r"^kvjax:generation_tokens_total(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def guidellm_venv(c) -> str:
  """The venv's guidellm executable, installing `c.guidellm` there when it is missing."""
  venv = os.path.expanduser(c.venv)
  exe = os.path.join(venv, "bin", "guidellm")
  requirement = c.guidellm.split("==")
  check = [os.path.join(venv, "bin", "python"), "-c",
           "import importlib.metadata as m, sys; v = m.version('guidellm'); "
           f"sys.exit(len({requirement!r}) > 1 and v != {requirement[-1]!r})"]
  if os.path.exists(exe) and subprocess.run(check, capture_output=True).returncode == 0:
    return exe
  print(f"installing {c.guidellm} into {venv} (a few minutes; bounded by "
        f"{c.install_timeout_s} s)", flush=True)
  subprocess.run([sys.executable, "-m", "venv", venv], check=True)
  start = time.monotonic()
  pip = subprocess.Popen([os.path.join(venv, "bin", "pip"), "install", "--progress-bar",
                          "off", *c.also_install, c.guidellm], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
  for line in pip.stdout:  # progress: pip's own lines, the collected packages
    if line.startswith(("Collecting", "Installing", "Successfully")):
      print(f"  [{time.monotonic() - start:5.0f} s] {line.strip()[:100]}", flush=True)
    if time.monotonic() - start > c.install_timeout_s:
      pip.kill()
      raise RuntimeError(f"pip install {c.guidellm} ran past {c.install_timeout_s} s")
  if pip.wait() != 0:
    raise RuntimeError(f"pip install {c.guidellm} failed (exit {pip.returncode})")
  return exe


def write_tokenizer(checkpoint: str, directory: str) -> None:
  """The served GGUF model's tokenizer as a Hugging Face tokenizer directory."""
  from kvjax.weights.gguf import gguf_path
  from kvjax.weights.gguf_tokenizer import load_gguf_tokenizer
  tokenizer = load_gguf_tokenizer(gguf_path(checkpoint))
  with open(os.path.join(directory, "tokenizer.json"), "w") as f:
    f.write(tokenizer.to_json())
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens,
               "chat_template": tokenizer.chat_template}, f)


def generated_tokens(root: str) -> float:
  """The server's kvjax:generation_tokens_total."""
  return float(_GENERATED.search(httpx.get(root + "/metrics", timeout=30).text).group(1))


def guidellm_run(c, exe: str, server: ServeProcess, tokenizer_dir: str, streams: int,
                 out_path: str) -> dict:
  """One guidellm run (its concurrent profile at `streams`); its benchmark JSON."""
  command = [exe, "run",
             "--backend", f"kind=openai_http,target={server.root},model={server.model}",
             "--profile", f"kind=concurrent,streams={streams}",
             "--constraint", f"kind=max_requests,count={c.requests}",
             "--data", f"kind=synthetic_text,prompt_tokens={c.prompt_tokens},"
                       f"output_tokens={c.output_tokens}",
             "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
             "--output", f"kind=json,path={out_path}", "--disable-console-interactive"]
  print(f"guidellm: {streams} stream(s), {c.requests} requests", flush=True)
  run = subprocess.run(command, capture_output=True, text=True, timeout=c.run_timeout_s)
  if run.returncode != 0:
    raise RuntimeError(f"guidellm exited {run.returncode}:\n{run.stdout[-3000:]}\n"
                       f"{run.stderr[-3000:]}")
  with open(out_path) as f:
    return json.load(f)["benchmarks"][0]


def summary(benchmark: dict, server_generated: float) -> dict:
  """What one guidellm benchmark says: request counts, token counts, latency medians."""
  metrics = benchmark["metrics"]
  done = benchmark["requests"]["successful"]

  def median(name):
    return metrics[name]["successful"]["median"]
  return {
      "requests": metrics["request_totals"],
      "output_tokens": [r["output_tokens"] for r in done],
      "server_generated_tokens": server_generated,
      "output_tokens_per_iteration_median": median("output_tokens_per_iteration"),
      "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
      "ttft_ms_median": median("time_to_first_token_ms"),
      "itl_ms_median": median("inter_token_latency_ms"),
      "tpot_ms_median": median("time_per_output_token_ms"),
      "errors": [r["info"].get("error") for r in benchmark["requests"]["errored"]][:5],
  }


def plot(results: dict, path: str) -> None:
  runs = results["runs"]
  with common.figure(path, 1, 2, figsize=(9, 3.5)) as (_, (left, right)):
    names = list(runs)
    left.bar(names, [runs[n]["output_tokens_per_s"] for n in names])
    left.set(xlabel="requests in flight", ylabel="output tokens / s",
             title="guidellm: throughput")
    width = 0.27
    for k, (key, label) in enumerate((("ttft_ms_median", "TTFT"), ("itl_ms_median", "ITL"),
                                      ("tpot_ms_median", "TPOT"))):
      right.bar([i + (k - 1) * width for i in range(len(names))],
                [runs[n][key] for n in names], width, label=label)
    right.set_xticks(range(len(names)), names)
    right.set(xlabel="requests in flight", ylabel="ms (median)", yscale="log",
              title="guidellm: latencies")
    right.legend()


def run(c) -> dict:
  results = {"device": common.device_label(), "cores": os.cpu_count(),
             "load_before": os.getloadavg(), "config": c.to_dict(), "runs": {}}
  exe = guidellm_venv(c)
  with tempfile.TemporaryDirectory() as tmp:
    write_tokenizer(c.checkpoint, tmp)
    print("starting kvjax serve (full warm-up: its step programs compile first)", flush=True)
    with ServeProcess(["--checkpoint", c.checkpoint, *c.serve_args], timeout_s=900) as server:
      results["server_started_s"] = server.started_s
      for streams in c.streams:
        before = generated_tokens(server.root)
        benchmark = guidellm_run(c, exe, server, tmp, streams,
                                 os.path.join(tmp, f"guidellm_{streams}.json"))
        results["runs"][str(streams)] = summary(benchmark,
                                                generated_tokens(server.root) - before)
  results["load_after"] = os.getloadavg()
  results["table"] = table(c, results)
  print(f"guidellm_bench on {results['device']} ({c.guidellm}, {c.checkpoint})")
  common.print_claims(results["table"], "{claim:<5} {what:<78} {seed:<22} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=lambda p: plot(results, p))
  return results


def table(c, results: dict) -> list:
  rows = []
  for streams, r in results["runs"].items():
    counts, totals = r["output_tokens"], r["requests"]
    where = f"{streams} in flight"
    rows += [
        {"claim": "#32", "what": f"guidellm requests errored / sent, {where}",
         "seed": "goal 0", "ours": f"{totals['errored']} / {totals['total']}"},
        {"claim": "#32", "what": f"output tokens per request (guidellm's count; asked "
                                 f"{c.output_tokens}), {where}",
         "seed": f"goal {c.output_tokens} each",
         "ours": f"{min(counts)}..{max(counts)} over {len(counts)}; server counted "
                 f"{r['server_generated_tokens']:.0f} = {sum(counts)} summed"},
        {"claim": "#32", "what": f"output tokens per stream iteration (median), {where}",
         "seed": "was 15.5", "ours": f"{r['output_tokens_per_iteration_median']:.2f}"},
        {"claim": "#32", "what": f"ITL / TPOT (medians), {where}",
         "seed": f"goal <= {c.itl_goal} (was 13.7)",
         "ours": f"{r['itl_ms_median'] / r['tpot_ms_median']:.2f}"},
        {"claim": "#32", "what": f"output tok/s; TTFT, ITL, TPOT medians (ms), {where}",
         "seed": "-", "ours": f"{r['output_tokens_per_s']:.1f}; {r['ttft_ms_median']:.0f}, "
                              f"{r['itl_ms_median']:.1f}, {r['tpot_ms_median']:.1f}"}]
  return rows


def main(argv):
  del argv
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined here, not at import: tests import launchers side by side, and absl allows
  # one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/guidellm_bench.py", "experiment config", lock_config=True)
  app.run(main)
