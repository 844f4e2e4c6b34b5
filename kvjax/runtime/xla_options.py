"""XLA compiler options for kvjax's step programs, chosen for the backend at first use.

On CPU, XLA hands dots (and, by default, more) to YNNPACK fusions.  Decode and
verify step programs give YNNPACK each dot on its own (LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT),
prefill programs none.  Measured on 2-core x86 VMs, the 4-layer, 256-wide model of
bench_decode, medians of 3-5 alternating runs:
  * YNNPACK runs the batched attention matmuls over gathered K/V 2-3x faster than
    XLA's own dot thunks, and its weight GEMMs no slower (AMD EPYC).
  * Letting it fuse the elementwise ops around the dots (the default set, or
    LIBRARY_FUSION_TYPE_DOT) makes one YNN subgraph of each MLP (gate, up, silu, down)
    that ran at 20 GFLOP/s, where its three dots alone ran at 60-100.  Intel Xeon,
    per decode step, fused dots / individual dots / every YNN fusion off:
    kvjax.generate batch 1 0.51 / 0.58 / 0.63 ms, batch 8 1.62 / 1.30 / 1.28 ms; the
    engine at batch 32 5.06 / 4.09 / 4.89 ms.  (AMD EPYC, before individual dots were
    tried, fused dots / all off: engine batch 8 1.78 / 2.20 ms, batch 32 7.1 / 10.0;
    the default set cost an MTP verify+draft step at batch 1 4.55 ms against 2.21.)
  * Prefill chunks run XLA's own dots: with YNNPACK's, a prefill-heavy engine run of
    32 prompts of 512 tokens took 1.54-1.63 s instead of 1.20-1.37 s.
Both kinds schedule with CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED: the default
(concurrency-optimized) scheduler starts every independent op early, so a step
of QuantizedWeights dequantized all 210 SmolLM2-135M projections at the top of
the decode loop's body, 433 MB of float copies live at once (an int4 model then
reads more bytes per step than a float one); memory-optimized, 6.6 MB (each
float weight lives from its dequantization to its dot; the bool option
xla_cpu_enable_concurrency_optimized_scheduler=False changes nothing in this XLA;
decode steps dequantize nothing where kvjax/quant/qmatmul.py's custom call runs,
prefill chunks still do).
`jit_step` compiles a step program with these options on a CPU backend whose XLA
accepts them (checked once with a probe compile: an option this XLA does not know
would fail every compile), and with none elsewhere (GPU).

`use_compile_cache(directory)` (the command lines' --compile-cache) keeps every
compiled program in jax's persistent compilation cache, so a restart of the same
configuration loads its programs instead of compiling them: every program, however
fast it compiled (a server's step programs take 0.1-10 s each on a CPU, and the
small ones add up).  Its entries are kept by `ReplacingFileCache`, one file per
program as jax's own cache keeps them, but written whole and replaced on recompile: jax
recompiles a program whose entry it cannot read (a torn or corrupt file) and puts the
fresh one, which jax's own cache drops while the corrupt file stays, so every later
start warned and recompiled again.  `xla_compile_counts()` counts, from jax's monitoring events,
what XLA compiled and what came from that cache.
"""
from __future__ import annotations

import argparse
import functools
import os
import pathlib
import tempfile
import threading
import warnings
from typing import Callable, Optional

import jax

from kvjax.model import invariance

__all__ = ["step_compiler_options", "jit_step", "DECODE_COLUMNS", "add_compile_cache_flag",
           "default_compile_cache", "use_compile_cache", "xla_compile_counts",
           "ReplacingFileCache"]

# Per program kind (numbers in the module doc): decode and verify steps (a few columns
# per row: YNNPACK for each dot alone) and prefill chunks (XLA's own dots).
_CPU_STEP_OPTIONS = {
    "decode": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
               "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
    "prefill": {"xla_cpu_experimental_ynn_fusion_type": "",
                "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
}
# A step program whose StepBatch feeds at most this many columns per row is a decode
# or verify step (1 + J columns); prefill chunks are wider (kvjax/engine/sched/batching.py buckets).
DECODE_COLUMNS = 8


@functools.lru_cache(maxsize=None)
def step_compiler_options(kind: str = "decode") -> tuple:
  """((name, value), ...) for `kind` ("decode" or "prefill") step programs on the default
  backend; () if none apply."""
  if jax.default_backend() != "cpu":
    return ()
  options = _CPU_STEP_OPTIONS[kind]
  try:
    jax.jit(lambda x: x + 1, compiler_options=options).lower(1.0).compile()
  except Exception:  # this XLA lacks the option: compile as jax would by default
    return ()
  return tuple(options.items())


class _StepJit:
  """jax.jit(fun, **jit_kwargs), one per program kind, each built at first use with
  step_compiler_options(kind); a call's kind is that of its StepBatch argument (the
  positional `batch_argnum`; None: always "decode")."""

  def __init__(self, fun: Callable, batch_argnum: Optional[int], jit_kwargs: dict):
    functools.update_wrapper(self, fun)
    self._fun, self._batch_argnum, self._jit_kwargs = fun, batch_argnum, jit_kwargs
    self._jitted: dict = {}

  def jitted(self, kind: str = "decode"):
    if kind not in self._jitted:
      self._jitted[kind] = jax.jit(
          self._fun, compiler_options=dict(step_compiler_options(kind)) or None,
          **self._jit_kwargs)
    return self._jitted[kind]

  def kind_of(self, batch) -> str:
    return "decode" if batch.tokens.shape[1] <= DECODE_COLUMNS else "prefill"

  def __call__(self, *args, **kwargs):
    kind = "decode" if self._batch_argnum is None else self.kind_of(args[self._batch_argnum])
    # A call traces inside the switch its backend sets (kvjax/model/invariance.py); the backend is
    # a static argument, so a cached program was traced under the same switch.
    with invariance.batch_invariant(getattr(kwargs.get("backend"), "batch_invariant", False)):
      return self.jitted(kind)(*args, **kwargs)

  def _cache_size(self) -> int:
    """Programs compiled so far, every kind."""
    return sum(f._cache_size() for f in self._jitted.values())

  def __getattr__(self, name):  # lower, trace, ... of the decode program
    return getattr(self.jitted("decode"), name)


def jit_step(fun: Callable = None, *, batch_argnum: Optional[int] = None, **jit_kwargs):
  """`jax.jit` for a step program (usable as @jit_step(static_argnames=...)); batch_argnum:
  the positional StepBatch argument whose width picks the options (None: a decode loop)."""
  if fun is None:
    return functools.partial(jit_step, batch_argnum=batch_argnum, **jit_kwargs)
  return _StepJit(fun, batch_argnum, jit_kwargs)


def default_compile_cache() -> str:
  """$JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/kvjax/xla (~/.cache/kvjax/xla)."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "kvjax", "xla")


def add_compile_cache_flag(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--compile-cache", default=default_compile_cache(), metavar="DIR",
                      help="keep compiled XLA programs in DIR, so the next start of the same "
                           "model and settings loads them instead of compiling; none: off "
                           "(default: %(default)s)")


class ReplacingFileCache:
  """jax's persistent-cache interface (get, put) over one file per entry, named
  `<key>-cache` as jax's own LRUCache names them.  put writes a temp file and renames it
  over the entry: a killed process leaves no torn entry, and an entry jax could not read
  (jax puts a key only after its read missed or failed) is replaced."""

  _SUFFIX = "-cache"

  def __init__(self, path: str):
    self._path = pathlib.Path(path)  # the attribute jax's cache interface declares
    self._path.mkdir(parents=True, exist_ok=True)

  def _entry(self, key: str) -> pathlib.Path:
    if not key:
      raise ValueError("key cannot be empty")
    return self._path / f"{key}{self._SUFFIX}"

  def get(self, key: str) -> Optional[bytes]:
    try:
      return self._entry(key).read_bytes()
    except FileNotFoundError:
      return None

  def put(self, key: str, value: bytes) -> None:
    entry = self._entry(key)
    fd, temp = tempfile.mkstemp(dir=self._path, prefix=f".{entry.name}.")
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(value)
      os.replace(temp, entry)
    except BaseException:
      os.unlink(temp)
      raise


def _keep_entries_replacing() -> bool:
  """Have jax open its persistent cache as a ReplacingFileCache (on a local directory, with
  no size bound or content check, which need jax's own) -> whether it will.  jax opens the
  cache through jax._src.compilation_cache.get_file_cache, an internal: where this jax has
  none, jax's own cache stays (corrupt entries then recompile at every start)."""
  try:
    from jax._src import compilation_cache as jax_cache
    open_own = jax_cache.get_file_cache
  except (ImportError, AttributeError):
    warnings.warn("this jax has no jax._src.compilation_cache.get_file_cache: a corrupt "
                  "--compile-cache entry will recompile at every start")
    return False
  if getattr(open_own, "kvjax_replacing", False):
    return True

  def open_cache(path: str):
    if ("://" in path or getattr(jax.config, "jax_compilation_cache_max_size", -1) != -1
        or getattr(jax.config, "jax_compilation_cache_check_contents", False)):
      return open_own(path)
    return ReplacingFileCache(path), path

  open_cache.kvjax_replacing = True
  jax_cache.get_file_cache = open_cache
  return True


def use_compile_cache(directory: str) -> Optional[str]:
  """Turn jax's persistent compilation cache on in `directory` (created if missing), for
  every program; "none" turns it off.  -> the directory, or None.  Call it before the
  first compile: jax opens the cache once, at its first compile."""
  if directory == "none":
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  path = os.path.abspath(os.path.expanduser(directory))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  _keep_entries_replacing()
  return path


class _CompileCounts:
  """jax's compile events, counted: `backend_compile` comes once per program XLA hands
  out (compiled or loaded from the persistent cache), `cache_hits` once per load."""

  def __init__(self):
    self._lock = threading.Lock()
    self.requests = self.hits = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_duration(self, name: str, _seconds: float, **_) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
      with self._lock:
        self.requests += 1

  def _on_event(self, name: str, **_) -> None:
    if name == "/jax/compilation_cache/cache_hits":
      with self._lock:
        self.hits += 1


@functools.lru_cache(maxsize=None)
def _counts() -> _CompileCounts:
  return _CompileCounts()


def xla_compile_counts() -> tuple[int, int]:
  """(programs XLA compiled, programs loaded from the persistent cache) in this process
  since the first call (which starts the count)."""
  counts = _counts()
  with counts._lock:
    return counts.requests - counts.hits, counts.hits
