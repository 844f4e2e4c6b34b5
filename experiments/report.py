"""Every seed claim (C1-C18) beside what kvjax measured: results/*.json -> results/REPORT.md.

Each launcher writes its own JSON layout; one normalizer per results file turns
it into entries (claim, what, seed, ours, device, file), and a file with no
normalizer of its own is read through its "table" or "claims" list if it has
one.  Smoke runs (`*_runlocal.json`) are skipped.  The report has one row per
claim (each results file's first entry for it, then the rest, and every device
and file that measured it), then every entry by claim; a claim that no results
file measures is listed as such, with where the codebase implements it.

  python -m experiments.report [--results_dir=results] [--out=results/REPORT.md]
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Callable, Optional

from absl import app, flags

_RESULTS_DIR = flags.DEFINE_string("results_dir", "results", "where the launchers wrote")
_OUT = flags.DEFINE_string("out", "", "report path (default: <results_dir>/REPORT.md)")

CLAIMS = {
    "C1": "decode reuses K/V; cached K/V bit-identical to recomputed",
    "C2": "attention work no cache vs cache (~2n/3; 341.7x at 512; 7.5x pairs at 14)",
    "C3": "decode bandwidth bound (~1 FLOP/KV byte), prefill compute bound",
    "C4": "KV bytes per token and per request (7B/8B/70B, Qwen3.5-9B)",
    "C5": "concurrency from the KV budget (120 at 4K, 15 at 32K; sizing)",
    "C6": "shrinking the cache: MQA/GQA/MLA, int8/int4 KV",
    "C7": "contiguous max-length allocation wastes ~60%; paged ~4%, 2-4x throughput",
    "C8": "prefix cache shares whole blocks only",
    "C9": "verifying K+1 positions costs ~1 decode step",
    "C10": "speculative accept rule; mean accepted length 2.39 of 3",
    "C11": "MTP workspace shrinks the KV pool (188,847 -> 73,728 tokens)",
    "C12": "4-bit weights: 4x fewer bytes per step, faster",
    "C13": "replayed graph / jitted loop vs op-by-op (+12.5%, 19.7 s capture)",
    "C14": "batch 1 -> 10 keeps decode step time ~1x",
    "C15": "long histories: TTFT ~10x at turn 10, queueing, smaller batches",
    "C16": "sliding window bounds the cache, loses far context",
    "C17": "when the cache is not worth it (tiny outputs)",
    "C18": "diagnosis: TTFT -> prefill, TPOT -> decode, both -> concurrency",
}

# Where a claim lives in the code when no results file measures it.
FEATURES = {
    "C8": "kvjax/engine/sched/prefix_cache.py (block and token modes), tests/test_prefix_cache.py",
    "C10": "kvjax/runtime/speculative.py, pallas_kernels/spec_verify.py, tests/test_rejection_sample.py",
    "C16": "sliding windows in kvjax/model/config.py, page release in kvjax/engine/sched/scheduler.py, "
           "tests/test_sliding_window.py, tests/test_window_release.py",
    "C18": "kvjax/engine/metrics.py (TTFT, TPOT, ITL, KV utilization, input-token P95), "
           "tests/test_metrics.py",
}

_ORDER = {claim: i for i, claim in enumerate(CLAIMS)}


def _device(raw) -> str:
  """A launcher's device string (or common.describe_device's dict) -> 'CPU, 2 cores' (with
  the CPU model where the result names it) / 'GPU NVIDIA H200' / 'none (arithmetic)'."""
  if not raw:
    return "none (arithmetic)"
  if isinstance(raw, dict):
    if raw.get("platform") == "cpu":
      fake = f", {raw['num_devices']} fake devices" if raw.get("num_devices", 1) > 1 else ""
      model = f", {raw['cpu_model']}" if raw.get("cpu_model") else ""
      return f"CPU, {raw.get('cpu_count')} cores{model}{fake}"
    return f"GPU {raw.get('device_kind')}"
  low = raw.lower()
  if low.startswith("gpu:"):
    return "GPU " + raw.split(":", 1)[1]
  if "cuda" in low or "gpu" in low:
    return f"GPU ({raw})"
  cores = re.search(r"\bx(\d+)\b|(\d+) cores", raw)
  model = re.search(r"\bx\d+ \((.*)\)\s*$", raw)  # common.device_label's CPU model
  return ("CPU" + (f", {cores.group(1) or cores.group(2)} cores" if cores else "")
          + (f", {model.group(1)}" if model else ""))


def _fmt(value) -> str:
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def _claim_ids(label) -> list:
  """'C15/issue' -> ['C15']; 'issue' -> []."""
  return [c for c in re.findall(r"C\d+", str(label)) if c in CLAIMS]


def _entry(claim, what, seed, ours, device, file) -> dict:
  return dict(claim=claim, what=str(what), seed=_fmt(seed), ours=_fmt(ours), device=device,
              file=file)


def _from_rows(rows, device: str, file: str) -> list:
  """Generic: a list of dicts with claim, what, seed, ours (unit, match optional)."""
  out = []
  for row in rows or []:
    if not isinstance(row, dict) or "claim" not in row:
      continue
    ours = _fmt(row.get("ours"))
    if row.get("unit"):
      ours += f" {row['unit']}"
    if row.get("match") is not None:
      ours += " (match)" if row["match"] else " (MISMATCH)"
    for claim in _claim_ids(row["claim"]):
      out.append(_entry(claim, row.get("what", ""), row.get("seed", "-"), ours, device, file))
  return out


def _generic(data: dict, file: str) -> list:
  device = _device(data.get("device") or data.get("machine"))
  return _from_rows(data.get("table") or data.get("claims"), device, file)


def _bench_decode(data: dict, file: str) -> list:
  cfg, device = data["config"], _device(data.get("device"))
  tps = {(r["batch"], r["engine"]): r["tokens_per_s"] for r in data["rows"] if "tokens_per_s" in r}
  out = []
  for batch in cfg["batch_sizes"]:
    if (batch, "kvjax no cache") not in tps:
      continue
    speedup = tps[(batch, "kvjax paged")] / tps[(batch, "kvjax no cache")]
    what = (f"KV cache vs recompute, whole model, prompt {cfg['prompt_len']} + "
            f"{cfg['new_tokens']} new tokens, batch {batch}: tokens/s ratio")
    out.append(_entry("C2", what, "~2n/3 fewer attention FLOPs", f"{speedup:.1f}x", device, file))
    out.append(_entry("C17", what + " (long outputs: the cache pays)", "cache pays",
                      f"{speedup:.1f}x", device, file))
  return out


def _kernel_bench(data: dict, file: str) -> list:
  c9 = data["summary"]["c9"]
  ours = f"{c9['ours']:.2f}x at {c9['ours_at']} (range {c9['ours_min']:.2f}-{c9['ours_max']:.2f})"
  return [_entry("C9", c9["what"], c9["seed"], ours, _device(data.get("device")), file)]


def _memory_ledger(data: dict, file: str) -> list:
  return _from_rows(data["rows"], _device(data.get("device")), file)


def _serve_bench(data: dict, file: str) -> list:
  out = _generic(data, file)
  cache = data.get("b", {}).get("cache", {})
  if "prefix_hit_rate" in cache:
    page = data["config"]["page_size"]
    out.append(_entry("C8", f"prefix hit rate, multi-turn chats, {page}-token pages",
                      "whole blocks only (30-token prompt, >60-token blocks: 0%)",
                      f"{cache['prefix_hit_rate']:.1%}", _device(data.get("machine")), file))
  return out


def _hybrid_bench(data: dict, file: str) -> list:
  """Its rows worked out from a preset's shape alone carry "arithmetic": true."""
  measured = _device(data.get("device"))
  return [entry for row in data["table"]
          for entry in _from_rows([row], _device(None) if row.get("arithmetic") else measured,
                                  file)]


NORMALIZERS: dict[str, Callable[[dict, str], list]] = {
    "bench_decode": _bench_decode,
    "hybrid_bench": _hybrid_bench,
    "kernel_bench": _kernel_bench,
    "kernel_bench_default_tiling": _kernel_bench,
    "memory_ledger": _memory_ledger,
    "serve_bench": _serve_bench,
}


def collect(results_dir: str) -> tuple[list, list]:
  """-> (entries sorted by claim, [(file, device, number of entries)])."""
  entries, files = [], []
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    name = os.path.basename(path)[:-len(".json")]
    if name.endswith("_runlocal"):
      continue
    with open(path) as f:
      data = json.load(f)
    if not isinstance(data, dict):
      raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    found = NORMALIZERS.get(name, _generic)(data, os.path.basename(path))
    files.append((os.path.basename(path), _device(data.get("device") or data.get("machine")),
                  len(found)))
    entries += found
  entries.sort(key=lambda e: _ORDER[e["claim"]])  # stable: file order within a claim
  return entries, files


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def _summary_row(claim: str, mine: list, headline: int) -> str:
  if not mine:
    where = FEATURES.get(claim)
    ours = "no measurement" + (f" (implemented: {where})" if where else "")
    return f"| {claim} | {_cell(CLAIMS[claim])} | - | {_cell(ours)} | - | - |"
  files = [e["file"] for e in mine]
  first = [i for i, f in enumerate(files) if files.index(f) == i]  # each file's first entry
  order = first + [i for i in range(len(mine)) if i not in first]
  shown = [mine[i] for i in order[:headline]]
  more = len(mine) - len(shown)
  seed = "<br>".join(_cell(e["seed"]) for e in shown)
  ours = "<br>".join(f"{_cell(e['what'])}: **{_cell(e['ours'])}**" for e in shown)
  if more > 0:
    ours += f"<br>(+{more} more below)"
  devices = ", ".join(dict.fromkeys(e["device"] for e in mine))
  return (f"| {claim} | {_cell(CLAIMS[claim])} | {seed} | {ours} | {devices} | "
          f"{', '.join(dict.fromkeys(files))} |")


def render(entries: list, files: list, headline: int = 3) -> str:
  """Markdown: summary table (one row per claim), every entry, files read."""
  by_claim = {claim: [e for e in entries if e["claim"] == claim] for claim in CLAIMS}
  lines = ["# Seed claims vs kvjax measurements", "",
           "Generated by `python -m experiments.report` from `results/*.json`; do not edit by "
           "hand. The claims are stated in [`docs/CLAIMS.md`](../docs/CLAIMS.md).", "",
           "| claim | what the seed claims | seed | ours | device | results file |",
           "| --- | --- | --- | --- | --- | --- |"]
  lines += [_summary_row(claim, mine, headline) for claim, mine in by_claim.items()]
  lines += ["", "## Every entry", ""]
  for claim, mine in by_claim.items():
    if not mine:
      continue
    lines += [f"### {claim}: {CLAIMS[claim]}", "", "| what | seed | ours | device | file |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {_cell(e['what'])} | {_cell(e['seed'])} | {_cell(e['ours'])} | {e['device']} | "
              f"{e['file']} |" for e in mine]
    lines.append("")
  lines += ["## Files read", "", "| file | device | entries |", "| --- | --- | --- |"]
  lines += [f"| {name} | {device} | {count} |" for name, device, count in files]
  return "\n".join(lines) + "\n"


def write_report(results_dir: str, out: str) -> list:
  """Write the report; returns its entries."""
  entries, files = collect(results_dir)
  with open(out, "w") as f:
    f.write(render(entries, files))
  return entries


def main(argv):
  del argv
  out = _OUT.value or os.path.join(_RESULTS_DIR.value, "REPORT.md")
  entries = write_report(_RESULTS_DIR.value, out)
  measured = sorted({e["claim"] for e in entries}, key=_ORDER.get)
  missing = [c for c in CLAIMS if c not in measured]
  print(f"wrote {out}: {len(entries)} entries; measured {', '.join(measured)}; "
        f"no measurement: {', '.join(missing) or 'none'}")


if __name__ == "__main__":
  app.run(main)
