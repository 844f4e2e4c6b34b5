"""A QuantizedWeight matmul that reads the integer codes, for decode rows on the CPU.

XLA:CPU has no fast path for a weight stored as int8 / int4 codes: dequantize-then-dot
(QuantizedWeight.dequantize) reads the codes, writes and reads back a float copy, and
an s8 x s8 -> s32 dot_general (the activation row quantized to int8) runs at ~5 GB/s
of codes on the issue's EPYC, no faster than the float32 dot reads 4x the bytes
(experiments/quant_matvec_bench.py, results/quant_matvec_bench.json).  qmatmul.cc is
an XLA FFI custom call that streams the codes once and accumulates f32 products of
the exact codes per group (so it matches the dequantized weight to f32 rounding), its
column blocks spread over XLA's intra-op threads.

`qmatmul(x, w)` is that call; `available()` says whether it can run here: one CPU
device (the call has no partitioning rule for a sharded weight) and a C++ compiler
(g++ or $CXX) that built qmatmul.cc, once per source and host into
$XDG_CACHE_HOME/kvjax/kernels (KVJAX_QMATMUL=0 turns it off).  Elsewhere
`layers.dense` dequantizes as before; it also does for wide inputs (prefill chunks,
more than MAX_ROWS rows), where XLA's dots reuse each weight across many rows.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.quant.qweight import QuantizedWeight

__all__ = ["MAX_ROWS", "TARGET", "available", "qmatmul"]

MAX_ROWS = 32  # qmatmul.cc's kMaxRows: decode (B rows) and verify (B * (1 + J)) steps
TARGET = "kvjax_qmatmul"
_SOURCE = os.path.join(os.path.dirname(__file__), "qmatmul.cc")


def _host() -> str:
  """The CPU -march=native builds for: its model and feature flags."""
  try:
    with open("/proc/cpuinfo") as f:
      return "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
  except OSError:
    return platform.machine() + platform.processor()


def _library_path() -> str:
  with open(_SOURCE, "rb") as f:
    key = hashlib.sha256(f.read() + _host().encode() + jax.__version__.encode()).hexdigest()[:16]
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "kvjax", "kernels", f"qmatmul-{key}.so")


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether qmatmul runs here (built and registered with XLA on the first call)."""
  with _LOCK:  # lru_cache may run two first calls at once: build and register once
    return _build_and_register()


def _build_and_register() -> bool:
  compiler = os.environ.get("CXX") or shutil.which("g++")
  if (os.environ.get("KVJAX_QMATMUL") == "0" or jax.default_backend() != "cpu" or
      jax.device_count() != 1 or not compiler):
    return False
  path = _library_path()
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}"
    build = subprocess.run(
        [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
         "-I", jax.ffi.include_dir(), _SOURCE, "-o", partial], capture_output=True, text=True)
    if build.returncode:
      warnings.warn(f"kvjax qmatmul: {compiler} could not build {_SOURCE}, so quantized "
                    f"weights dequantize for every matmul:\n{build.stderr[-2000:]}")
      return False
    os.replace(partial, path)  # atomic: a concurrent builder loads a whole file
  library = ctypes.CDLL(path)
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.KvjaxQMatmul), platform="cpu")
  return True


def qmatmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
  """x [rows, I] @ w viewed as [I, O] -> f32 [rows, O], rows <= MAX_ROWS (available() must
  hold)."""
  x = x.astype(jnp.float32)
  if w.in_scale is not None:  # AWQ: row i of the weight is divided by s_i
    x = x / w.in_scale
  offsets = w.offsets if w.offsets is not None else jnp.zeros((0, w.scales.shape[1]),
                                                                jnp.float32)
  out = jax.ShapeDtypeStruct((x.shape[0], w.scales.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out)(x, w.codes, w.scales, offsets,
                                       group=np.int64(w.group_size), bits=np.int64(w.bits))
