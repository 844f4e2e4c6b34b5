"""HTTP load generator for an OpenAI-compatible kvjax server: arrivals, streaming, statistics.

  result = run_benchmark(url, sessions, request_rate=8.0, burstiness=1.0, max_concurrency=16,
                         goodput={"ttft": 0.2, "tpot": 0.02}, encode=tokenizer.encode)

`sessions` are kvjax.server.bench.workloads.Session objects (its workload generators make
them): a session starts at its arrival time and sends its turns one after
the other, each turn's prompt being the history (earlier prompts and answers)
plus its new user message, as token ids to POST /v1/completions.  Arrivals
follow vLLM's bench: gaps gamma-distributed with shape `burstiness` and mean
1 / request_rate (burstiness 1 = Poisson), every session at once for an
infinite rate; at most `max_concurrency` requests are in flight.  Every
request streams (SSE) with stream_options.include_usage, and the client
times it itself from sending the request: TTFT to the first chunk with text,
ITL between chunks with text, E2E to the last chunk, TPOT = (E2E - TTFT) /
(output tokens - 1), output tokens from the usage chunk.  A goodput request
meets every target given (ttft, tpot, e2el; seconds).  While the load runs,
a sampler scrapes the server's /metrics gauges every `metrics_interval_s`;
the first and last full scrapes bound the window kvjax.server.bench.diagnose reads.
Connections go straight to the URL (no proxies from the environment).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from kvjax.engine.metrics import distribution
from kvjax.server.bench import diagnose

__all__ = ["RequestRecord", "arrival_gaps", "parse_goodput", "run_benchmark", "summarize",
           "format_table", "plot"]

GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestRecord:
  """One request as the client saw it; times in seconds (start_s from the bench start)."""

  session: int
  turn: int
  start_s: float
  prompt_tokens: int
  success: bool = False
  error: str = ""
  output_tokens: int = 0
  ttft_s: Optional[float] = None
  tpot_s: Optional[float] = None
  e2e_s: Optional[float] = None
  itls_s: list = dataclasses.field(default_factory=list)
  finish_reason: Optional[str] = None
  text: str = ""


def arrival_gaps(count: int, request_rate: float, burstiness: float = 1.0,
                 rng: Optional[np.random.Generator] = None) -> np.ndarray:
  """[count] gaps before each arrival: gamma(shape=burstiness, mean=1/rate); zeros at inf rate."""
  if not request_rate > 0:
    raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
  if not (burstiness > 0 and math.isfinite(burstiness)):
    raise ValueError(f"burstiness must be a positive number, got {burstiness}")
  if math.isinf(request_rate):
    return np.zeros(count)
  rng = rng or np.random.default_rng(0)
  return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)


def parse_goodput(specs: Sequence[str]) -> dict:
  """["ttft:200", "tpot:20"] (milliseconds) -> {"ttft": 0.2, "tpot": 0.02} (seconds)."""
  targets = {}
  for spec in specs:
    key, sep, value = spec.partition(":")
    if not sep or key not in GOODPUT_KEYS:
      raise ValueError(f"goodput target {spec!r} must be KEY:MS with KEY one of {GOODPUT_KEYS}")
    try:
      ms = float(value)
    except ValueError:
      raise ValueError(f"goodput target {spec!r}: {value!r} is not a number of milliseconds")
    if not ms > 0:
      raise ValueError(f"goodput target {spec!r} must be > 0 ms")
    targets[key] = ms / 1e3
  return targets


def _is_good(record: RequestRecord, targets: Mapping[str, float]) -> bool:
  measured = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s}
  return record.success and all(measured[k] <= v for k, v in targets.items())


async def _stream(client, url: str, body: dict, record: RequestRecord, clock0: float) -> None:
  """POST one streaming completion and fill `record` with what arrived and when."""
  sent = time.perf_counter()
  record.start_s = sent - clock0
  arrivals, pieces = [], []
  async with client.stream("POST", url + "/v1/completions", json=body) as response:
    if response.status_code != 200:
      record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
      return
    async for line in response.aiter_lines():
      if not line.startswith("data: "):
        continue
      payload = line[len("data: "):]
      if payload == "[DONE]":
        break
      chunk = json.loads(payload)
      if chunk.get("usage"):
        record.output_tokens = chunk["usage"]["completion_tokens"]
        record.prompt_tokens = chunk["usage"]["prompt_tokens"]
      for choice in chunk.get("choices") or ():
        if choice.get("text"):
          arrivals.append(time.perf_counter())
          pieces.append(choice["text"])
        if choice.get("finish_reason"):
          record.finish_reason = choice["finish_reason"]
  record.text = "".join(pieces)
  if not arrivals:
    record.error = "no text streamed"
    return
  record.success = True
  record.ttft_s = arrivals[0] - sent
  record.e2e_s = arrivals[-1] - sent
  record.itls_s = list(np.diff(arrivals))
  if record.output_tokens > 1:
    record.tpot_s = (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)


async def _sample_gauges(client, url: str, interval_s: float, clock0: float, samples: list,
                         done: asyncio.Event) -> None:
  """Scrapes /metrics gauges every interval until `done` (one sample per interval at most)."""
  while not done.is_set():
    try:
      response = await client.get(url + "/metrics")
      gauges = diagnose.parse_metrics(response.text).gauges
      samples.append({"t": time.perf_counter() - clock0, **gauges})
    except Exception:  # pylint: disable=broad-except
      pass  # a missed sample is not a failed benchmark
    try:
      await asyncio.wait_for(done.wait(), interval_s)
    except asyncio.TimeoutError:
      pass


async def _run(url: str, sessions, *, model: Optional[str], request_rate: float,
               burstiness: float, max_concurrency: Optional[int], encode, sampling: dict,
               seed: int, timeout_s: float, metrics_interval_s: Optional[float]):
  import httpx

  limits = httpx.Limits(max_connections=max_concurrency or len(sessions) or 1,
                        max_keepalive_connections=max_concurrency or len(sessions) or 1)
  # /metrics gets its own connection: in the requests' pool a scrape would wait for
  # a request to finish, and see the server only between requests.
  async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client, \
      httpx.AsyncClient(timeout=timeout_s, trust_env=False) as scraper:
    if model is None:
      listed = (await scraper.get(url + "/v1/models")).json()["data"]
      model = listed[0]["id"]
    first_metrics = await _metrics_text(scraper, url)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    clock0 = time.perf_counter()

    async def one(index: int, session, delay: float) -> None:
      await asyncio.sleep(delay)
      history: list[int] = []
      for turn, message in enumerate(session.turns):
        history = history + list(message)
        record = RequestRecord(index, turn, 0.0, len(history))
        records.append(record)
        body = {"model": model, "prompt": history, "max_tokens": session.max_new_tokens,
                "stream": True, "stream_options": {"include_usage": True}, **sampling}
        if session.schema is not None:  # the structured workload
          body["response_format"] = {"type": "json_schema", "json_schema": {
              "name": "bench", "schema": session.schema}}
        try:
          if gate is None:
            await asyncio.wait_for(_stream(client, url, body, record, clock0), timeout_s)
          else:
            async with gate:
              await asyncio.wait_for(_stream(client, url, body, record, clock0), timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError, KeyError) as error:
          record.error = f"{type(error).__name__}: {error}"
        if not record.success:
          return  # a chat whose turn failed has no history to go on with
        if turn + 1 < len(session.turns):
          history = history + encode(record.text)

    gaps = arrival_gaps(len(sessions), request_rate, burstiness, np.random.default_rng(seed))
    done, samples = asyncio.Event(), []
    sampler = (asyncio.create_task(_sample_gauges(scraper, url, metrics_interval_s, clock0,
                                                  samples, done))
               if metrics_interval_s and first_metrics is not None else None)
    await asyncio.gather(*(one(i, s, d) for i, s, d in zip(range(len(sessions)), sessions,
                                                            np.cumsum(gaps))))
    duration = time.perf_counter() - clock0
    done.set()
    if sampler is not None:
      await sampler
    last_metrics = await _metrics_text(scraper, url)
  server = None
  if first_metrics is not None and last_metrics is not None:
    server = {"first": first_metrics, "last": last_metrics, "samples": samples}
  return records, duration, server


async def _metrics_text(client, url: str) -> Optional[str]:
  try:
    response = await client.get(url + "/metrics")
    return response.text if response.status_code == 200 else None
  except Exception:  # pylint: disable=broad-except
    return None  # a server without /metrics still gets benchmarked


def run_benchmark(url: str, sessions, *, request_rate: float = math.inf,
                  burstiness: float = 1.0, max_concurrency: Optional[int] = None,
                  goodput: Optional[Mapping[str, float]] = None,
                  encode: Optional[Callable[[str], list]] = None, model: Optional[str] = None,
                  temperature: float = 0.0, seed: int = 0, timeout_s: float = 600.0,
                  metrics_interval_s: Optional[float] = 0.5) -> dict:
  """Sends `sessions` to the server at `url` (its root) -> {"summary", "requests",
  "server_metrics"}.

  encode(text) -> ids turns an answer back into history ids (no special
  tokens: the answer continues the history); needed when a session has more
  than one turn.
  """
  if max_concurrency is not None and max_concurrency < 1:
    raise ValueError(f"max_concurrency must be >= 1 (None: unlimited), got {max_concurrency}")
  if encode is None and any(len(s.turns) > 1 for s in sessions):
    raise ValueError("multi-turn sessions need encode(text) -> ids for the answers")
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
  root = url.rstrip("/")
  root = root[:-3] if root.endswith("/v1") else root
  records, duration, server = asyncio.run(_run(
      root, sessions, model=model, request_rate=request_rate, burstiness=burstiness,
      max_concurrency=max_concurrency, encode=encode,
      sampling={"temperature": temperature, "seed": seed}, seed=seed, timeout_s=timeout_s,
      metrics_interval_s=metrics_interval_s))
  records.sort(key=lambda r: (r.start_s, r.session, r.turn))
  config = {"url": url, "request_rate": request_rate, "burstiness": burstiness,
            "max_concurrency": max_concurrency, "goodput": dict(goodput or {}),
            "num_sessions": len(sessions)}
  return {"config": config, "summary": summarize(records, duration, goodput or {}),
          "requests": [dataclasses.asdict(r) for r in records], "server_metrics": server}


def summarize(records: Sequence[RequestRecord], duration_s: float,
              goodput: Mapping[str, float]) -> dict:
  """Counts, throughputs, goodput and mean/median/P99 of TTFT, TPOT, ITL, E2E (seconds)."""
  done = [r for r in records if r.success]
  output_tokens = sum(r.output_tokens for r in done)
  input_tokens = sum(r.prompt_tokens for r in done)
  per_s = 1.0 / duration_s if duration_s > 0 else 0.0
  return {
      "completed": len(done), "failed": len(records) - len(done), "duration_s": duration_s,
      "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
      "request_throughput": len(done) * per_s, "output_throughput": output_tokens * per_s,
      "total_token_throughput": (input_tokens + output_tokens) * per_s,
      "goodput": (sum(_is_good(r, goodput) for r in done) * per_s) if goodput else None,
      "ttft": distribution(r.ttft_s for r in done),
      "tpot": distribution(r.tpot_s for r in done if r.tpot_s is not None),
      "itl": distribution(x for r in done for x in r.itls_s),
      "e2el": distribution(r.e2e_s for r in done),
  }


def format_table(summary: dict) -> str:
  lines = [f"  {'completed / failed':<24} {summary['completed']} / {summary['failed']}",
           f"  {'duration s':<24} {summary['duration_s']:.2f}",
           f"  {'request throughput /s':<24} {summary['request_throughput']:.2f}",
           f"  {'output tokens/s':<24} {summary['output_throughput']:.1f}",
           f"  {'total tokens/s':<24} {summary['total_token_throughput']:.1f}"]
  if summary["goodput"] is not None:
    lines.append(f"  {'goodput req/s':<24} {summary['goodput']:.2f}")
  for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
    d = summary[key]
    lines.append(f"  {label + ' mean/median/p99 ms':<24} {d['mean'] * 1e3:.1f} / "
                 f"{d['median'] * 1e3:.1f} / {d['p99'] * 1e3:.1f}")
  return "\n".join(lines)


def plot(result: dict, path: str, title: str) -> None:
  """TTFT and TPOT per request over time, the server's queue over time, latency bars."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  done = [r for r in result["requests"] if r["success"]]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  axes[0].plot([r["start_s"] for r in done], [r["ttft_s"] * 1e3 for r in done], ".", label="TTFT")
  axes[0].plot([r["start_s"] for r in done if r["tpot_s"] is not None],
               [r["tpot_s"] * 1e3 for r in done if r["tpot_s"] is not None], ".", label="TPOT")
  axes[0].set(xlabel="request start (s)", ylabel="ms", yscale="log", title="per request")
  axes[0].legend()
  samples = (result["server_metrics"] or {}).get("samples", [])
  for key in ("num_requests_running", "num_requests_waiting"):
    axes[1].plot([s["t"] for s in samples], [s.get(key, 0.0) for s in samples], label=key)
  axes[1].set(xlabel="time (s)", ylabel="requests", title="server /metrics")
  axes[1].legend()
  summary = result["summary"]
  names = ["ttft", "tpot", "itl", "e2el"]
  axes[2].bar(names, [summary[k]["mean"] * 1e3 for k in names], label="mean")
  axes[2].bar(names, [summary[k]["p99"] * 1e3 for k in names], alpha=0.4, label="p99")
  axes[2].set(ylabel="ms", yscale="log", title="latency")
  axes[2].legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
