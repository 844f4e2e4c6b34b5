"""`python -m kvjax serve` processes and `smg launch` over them, for the gateway tests and
experiments/gateway_bench.py: start on free loopback ports, stop; every wait bounded."""
from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The built-in byte-level code model (its tokenizer: smg forwards text prompts only) on
# small shapes.
TINY = ("--max-num-seqs", "2", "--max-num-batched-tokens", "32",
        "--max-model-len", "64", "--page-size", "16")
_URL = re.compile(r"kvjax serving (\S+) at (http://\S+)/v1")


def _terminate(proc: subprocess.Popen, grace_s: float) -> None:
  """SIGTERM, then SIGKILL if it is still up after grace_s seconds."""
  if proc.poll() is None:
    proc.terminate()
    try:
      proc.wait(grace_s)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(10)


class ServeProcess:
  """One `python -m kvjax serve` subprocess: `.root`, `.url` (…/v1), `.model`, `.stderr`
  (what it wrote so far), `.started_s` (seconds from launch to its URL line).  `cpus`:
  the cores it may run on (all by default), as one device group of its own."""

  def __init__(self, args: Sequence[str], timeout_s: float = 180.0,
               env: Optional[dict] = None, cpus: Optional[Sequence[int]] = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    start = time.perf_counter()
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    self.proc = subprocess.Popen([sys.executable, "-m", "kvjax", "serve", "--port", "0",
                                  *args], cwd=ROOT, env=env, text=True, preexec_fn=pin,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    self._err: list[str] = []
    self._err_thread = threading.Thread(target=self._read_stderr, daemon=True)
    self._err_thread.start()
    line = _readline(self.proc.stdout, timeout_s)
    match = _URL.search(line or "")
    if match is None:
      self.stop()
      raise RuntimeError(f"serve printed {line!r}, not its URL; stderr:\n{self.stderr}")
    self.started_s = time.perf_counter() - start
    self.model, self.url = match.group(1), match.group(2) + "/v1"
    self.root = match.group(2)

  def _read_stderr(self) -> None:
    for line in self.proc.stderr:
      self._err.append(line)

  @property
  def stderr(self) -> str:
    return "".join(self._err)

  def wait_for_stderr(self, pattern: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      match = re.search(pattern, self.stderr)
      if match:
        return match
      if self.proc.poll() is not None:
        break
      time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} on serve's stderr in {timeout_s} s:\n{self.stderr}")

  def complete(self, prompt: list[int], max_tokens: int, root: Optional[str] = None,
               **fields) -> dict:
    """A greedy /v1/completions answer (from `root`, default this server)."""
    answer = httpx.post((root or self.root) + "/v1/completions", timeout=60, json={
        "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        **fields})
    answer.raise_for_status()
    return answer.json()

  def stop(self) -> None:
    _terminate(self.proc, 30)
    self._err_thread.join(10)

  def __enter__(self) -> "ServeProcess":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def _readline(stream, timeout_s: float) -> Optional[str]:
  """stream.readline() within timeout_s (None past it)."""
  lines: list = []
  reader = threading.Thread(target=lambda: lines.append(stream.readline()), daemon=True)
  reader.start()
  reader.join(timeout_s)
  return lines[0] if lines else None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Gateway:
  """`smg launch` over `workers`; `.root`; every wait bounded."""

  def __init__(self, workers, log_path, policy: str = "cache_aware", timeout_s: float = 60):
    port = _free_port()
    self.root = f"http://127.0.0.1:{port}"
    self._log = open(log_path, "w")
    self.log_path = log_path
    self.proc = subprocess.Popen(
        ["smg", "launch", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *[w.root for w in workers], "--policy", policy,
         "--prometheus-port", str(_free_port()), "--health-check-interval-secs", "1",
         "--request-timeout-secs", "60", "--log-level", "debug"],
        stdout=self._log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while self.num_workers() < len(workers):
      if self.proc.poll() is not None or time.monotonic() > deadline:
        self.stop()
        raise RuntimeError(f"smg registered {self.num_workers()} of {len(workers)} workers; "
                           f"log:\n{open(log_path).read()[-3000:]}")
      time.sleep(0.25)

  def num_workers(self) -> int:
    try:
      listing = httpx.get(self.root + "/workers", timeout=5).json()
    except (httpx.HTTPError, ValueError):
      return 0
    return len(listing.get("workers", listing) if isinstance(listing, dict) else listing)

  def stop(self) -> None:
    _terminate(self.proc, 15)
    self._log.close()
