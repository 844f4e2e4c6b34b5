"""What the experiment launchers share: interleaved timing, medians, the device
description, the results JSON and the PNG beside it.

  timings = interleaved({"ours": f, "theirs": g}, repeats=5)  # untimed call each, then rounds
  timings.medians()                     # name -> median seconds per call
  device_label()                        # 'CPU x86_64 x2' / 'gpu:NVIDIA H200'
  write_results(out_dir, name, results, plot=draw)  # <name>.json, then draw(<name>.png)
  with figure(path, 1, 2, figsize=(10, 4)) as (fig, axes): ...  # Agg, tight, saved, closed

Timing runs every variant in turn, round after round, so load from other
processes on a shared machine, and its drift over minutes, hits every variant
alike; the first call of each is left out (compilation, caches).  Nothing here
imports kvjax; jax and matplotlib are imported when first needed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import statistics
import time
import urllib.request
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence


# -- timing ---------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
  """The median (the mean of the middle two of an even count)."""
  return statistics.median(values)


def median_item(items: Sequence[Any], key: Callable[[Any], float]) -> Any:
  """The middle item by `key` (the upper middle of an even count): one real run, not a mean."""
  return sorted(items, key=key)[len(items) // 2]


@dataclasses.dataclass
class Timings:
  """What `interleaved` measured, per run name.

  seconds:       seconds per call, one sample per round.
  results:       the run's return value, one per round (the last call's when inner > 1).
  first_seconds: seconds of the first untimed call (compilation included).
  first_results: what the first untimed call returned.
  """
  seconds: dict
  results: dict
  first_seconds: dict
  first_results: dict

  def medians(self) -> dict:
    """name -> median seconds per call."""
    return {name: median(samples) for name, samples in self.seconds.items()}

  def median_results(self, key: Callable[[Any], float]) -> dict:
    """name -> the round's result whose `key` is the median (`median_item`)."""
    return {name: median_item(results, key) for name, results in self.results.items()}


def interleaved(runs: Mapping[Hashable, Callable[[], Any]], repeats: int, *, warmup: int = 1,
                inner: int = 1, max_rounds: Optional[Mapping[Hashable, int]] = None,
                block: Optional[Callable[[Any], Any]] = None) -> Timings:
  """Times the callables of `runs` in alternating rounds.

  Each run is first called `warmup` times untimed; then `repeats` rounds call
  every run in turn, `inner` times back to back per sample (a sample is its
  time / inner).  A run named in `max_rounds` sits out the rounds past its
  count (a baseline slow by design).  `block(out)`, e.g. jax.block_until_ready,
  waits for asynchronous work before a clock stops.
  """
  if repeats < 0 or warmup < 0 or inner < 1:
    raise ValueError(f"need repeats >= 0, warmup >= 0, inner >= 1; got repeats={repeats}, "
                     f"warmup={warmup}, inner={inner}")
  unknown = set(max_rounds or {}) - set(runs)
  if unknown:
    raise ValueError(f"max_rounds names runs that do not exist: {sorted(map(str, unknown))}")
  wait = block or (lambda out: out)
  timings = Timings({name: [] for name in runs}, {name: [] for name in runs}, {}, {})
  for name, fn in runs.items():
    for i in range(warmup):
      start = time.perf_counter()
      out = wait(fn())
      if i == 0:
        timings.first_seconds[name] = time.perf_counter() - start
        timings.first_results[name] = out
  for round_index in range(repeats):
    for name, fn in runs.items():
      if max_rounds and name in max_rounds and round_index >= max_rounds[name]:
        continue
      start = time.perf_counter()
      for _ in range(inner):
        out = fn()
      wait(out)
      timings.seconds[name].append((time.perf_counter() - start) / inner)
      timings.results[name].append(out)
  return timings


def median_seconds(fn: Callable[[], Any], repeats: int, **kwargs) -> float:
  """Median seconds per call of one callable; kwargs as `interleaved`'s."""
  return interleaved({"fn": fn}, repeats, **kwargs).medians()["fn"]


def decode_tokens_per_s(engine, new_tokens: int) -> float:
  """Decode tokens/s of a kvjax Engine's queued requests (each asking `new_tokens`): steps
  until every request has its first token (prefill, untimed), then times the rest."""
  requests = engine.scheduler.requests.values()
  while any(r.num_output_tokens == 0 for r in requests):
    engine.step()
  start = time.perf_counter()
  decoded = sum(new_tokens - r.num_output_tokens for r in requests)
  list(engine.stream())
  return decoded / (time.perf_counter() - start)


# -- the device -----------------------------------------------------------------


def describe_device() -> dict:
  """The machine a result comes from: platform, device kind and count, host CPUs (model,
  speed-relevant flags), the 1 / 5 / 15-minute load average as the run ends (other jobs
  on a shared machine), OS, jax."""
  import jax  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  return dict(platform=device.platform, device_kind=getattr(device, "device_kind", ""),
              num_devices=jax.device_count(), cpu_count=os.cpu_count(),
              machine=platform.machine(), cpu_model=cpu_model(), cpu_flags=cpu_flags(),
              load_average=list(os.getloadavg()), os=platform.platform(),
              jax=jax.__version__)


# The CPU features a speed result depends on (kvjax/quant/qmatmul.cc picks its kernel by
# them; XLA:CPU's dots too): an AVX2-only CPU and an AVX-512 one differ by 3x on int4.
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")


def cpu_flags() -> dict:
  """SPEED_FLAGS -> whether the host CPU has it (`lscpu`'s / /proc/cpuinfo's flags;
  empty where the OS does not say)."""
  try:
    with open("/proc/cpuinfo") as cpuinfo:
      flags = next((line.split(":", 1)[1].split() for line in cpuinfo
                    if line.startswith("flags")), None)
  except OSError:
    flags = None
  return {} if flags is None else {flag: flag in flags for flag in SPEED_FLAGS}


def cpu_model() -> str:
  """The host CPU's model name ('' where the OS does not say): CPU ratios against torch
  depend on it (on an Intel Xeon with MKL, HF's batch-8 decode ran 2.2x faster than on
  an AMD EPYC VM of the same size, kvjax's 1.4x)."""
  try:
    with open("/proc/cpuinfo") as cpuinfo:
      for line in cpuinfo:
        if line.startswith("model name"):
          name = line.split(":", 1)[1]
          return " ".join(name.replace("(R)", "").replace("(TM)", "").split())
  except OSError:
    pass
  return platform.processor()


def device_label(info: Optional[dict] = None) -> str:
  """'CPU x86_64 x2 (<model name>)' on the CPU, else '<platform>:<device kind>'
  ('gpu:NVIDIA H200').

  experiments/report.py reads both forms ('CPU, 2 cores, <model name>', 'GPU NVIDIA H200').
  """
  info = info or describe_device()
  if info["platform"] == "cpu":
    model = f" ({info['cpu_model']})" if info.get("cpu_model") else ""
    return f"CPU {info['machine']} x{info['cpu_count']}{model}"
  return f"{info['platform']}:{info['device_kind']}"


# -- results --------------------------------------------------------------------


def claim_rows(rows) -> list:
  """(claim, what, seed, ours) tuples -> the dicts experiments/report.py reads."""
  return [dict(zip(("claim", "what", "seed", "ours"), row)) for row in rows]


def print_claims(rows, line: str, ours_format: str = "{}") -> None:
  """A header, then one line per claim row; `line` formats claim, what, seed and ours (str)."""
  print(line.format(claim="claim", what="what", seed="seed", ours="ours"))
  for row in rows:
    print(line.format(**{**row, "ours": ours_format.format(row["ours"])}))


def _json_default(value):
  """numpy / jax scalars and arrays as numbers and lists; anything else as its str."""
  if hasattr(value, "tolist"):
    return value.tolist()
  return str(value)


def write_json(path: str, results, indent: int = 1) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=indent, default=_json_default)


def write_results(out_dir: str, name: str, results, *,
                  plot: Optional[Callable[[str], None]] = None, indent: int = 1) -> str:
  """<out_dir>/<name>.json, then plot(<out_dir>/<name>.png) if given; returns the stem."""
  stem = os.path.join(out_dir, name)
  write_json(stem + ".json", results, indent)
  if plot is None:
    print(f"wrote {stem}.json")
  else:
    plot(stem + ".png")
    print(f"wrote {stem}.json and {stem}.png")
  return stem


def wait_healthy(url: str, proc, timeout_s: float, what: str) -> None:
  """Poll `url`/health until it answers 200; RuntimeError naming `what` when the process
  (a subprocess.Popen) exits first or timeout_s passes."""
  deadline = time.monotonic() + timeout_s
  while True:
    if proc.poll() is not None:
      raise RuntimeError(f"{what} exited with {proc.returncode}")
    try:
      with urllib.request.urlopen(url + "/health", timeout=5) as answer:
        if answer.status == 200:
          return
    except OSError:
      pass
    if time.monotonic() > deadline:
      raise RuntimeError(f"{what} not healthy after {timeout_s} s")
    time.sleep(0.5)


# -- plots ----------------------------------------------------------------------


def pyplot():
  """matplotlib.pyplot on the Agg backend, imported on first use (setup.py's "plot" extra)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


@contextlib.contextmanager
def figure(path: str, *args, dpi: int = 100, **kwargs):
  """plt.subplots(*args, **kwargs) -> (fig, axes); on exit: tight layout, saved to path, closed."""
  plt = pyplot()
  fig, axes = plt.subplots(*args, **kwargs)
  try:
    yield fig, axes
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
  finally:
    plt.close(fig)
