"""A QuantizedWeight matmul that reads the integer codes, for decode rows on the CPU.

XLA:CPU has no fast path for a weight stored as int8 / int4 codes: dequantize-then-dot
(QuantizedWeight.dequantize) reads the codes, writes and reads back a float copy, and
an s8 x s8 -> s32 dot_general (the activation row quantized to int8) runs at ~5 GB/s
of codes on the issue's EPYC, no faster than the float32 dot reads 4x the bytes
(experiments/quant_matvec_bench.py, results/quant_matvec_bench.json).  qmatmul.cc is
an XLA FFI custom call that streams the codes once: x quantized to int8 per block of
ACTIVATION_BLOCK rows (an absmax scale each, as llama.cpp's Q8_0), integer dot products
with the codes (AVX2 / AVX-512 maddubs), one f32 multiply-add per block, so it differs
from the dequantized weight by x's rounding only (at most half a block's scale an
input), its column blocks spread over XLA's intra-op threads.

`qmatmul(x, w)` is that call; `available()` says whether it can run here: one CPU
device (the call has no partitioning rule for a sharded weight) and a C++ compiler
(g++ or $CXX) that built it, once per source and build flags into
$XDG_CACHE_HOME/kvjax/kernels (KVJAX_QMATMUL=0 turns it off).  The library is built
for the baseline CPU of its architecture with the band kernel compiled once per x86
ISA (generic, AVX2 + FMA, AVX-512 BW) and picked at run time, so it runs on any x86
CPU and the fastest kernel the CPU has; KVJAX_QMATMUL_ISA (or `isa=`) names one of
ISAS instead.  Elsewhere `layers.dense` dequantizes as before; it also does for wide
inputs (prefill chunks, more than MAX_ROWS rows), where XLA's dots reuse each weight
across many rows.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.quant.qweight import QuantizedWeight

__all__ = ["ACTIVATION_BLOCK", "ISAS", "MAX_ROWS", "TARGET", "available", "qmatmul",
           "supported_isas"]

MAX_ROWS = 32  # qmatmul.cc's kMaxRows: decode (B rows) and verify (B * (1 + J)) steps
ACTIVATION_BLOCK = 32  # qmatmul_kernel.h's kBlock: x's rows per int8 scale, in a group
ISAS = ("best", "generic", "avx2", "avx512")  # the call's `isa` attribute, in order
TARGET = "kvjax_qmatmul"
_DIR = os.path.dirname(__file__)
_SOURCES = tuple(os.path.join(_DIR, name)
                 for name in ("qmatmul.cc", "qmatmul_kernel.cc", "qmatmul_kernel.h"))
_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-ffp-contract=off")  # fma only where written
# The band kernel's targets, each compiled with its flags (x86 CPUs; elsewhere generic).
_X86_KERNELS = {"Generic": (), "Avx2": ("-mavx2", "-mfma"),
                "Avx512": ("-mavx512f", "-mavx512bw")}


def _kernels() -> dict:
  x86 = platform.machine().lower() in ("x86_64", "amd64")
  return _X86_KERNELS if x86 else {"Generic": ()}


def _library_path() -> str:
  """The build's cache path: a hash of the sources, what they are built for (the
  architecture and each kernel's flags), the compiler and jax."""
  digest = hashlib.sha256()
  for path in _SOURCES:
    with open(path, "rb") as f:
      digest.update(f.read())
  built_for = (platform.machine(), _FLAGS, sorted(_kernels().items()), _compiler(),
               jax.__version__)
  digest.update(repr(built_for).encode())
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "kvjax", "kernels", f"qmatmul-{digest.hexdigest()[:16]}.so")


def _compiler():
  return os.environ.get("CXX") or shutil.which("g++")


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether qmatmul runs here (built and registered with XLA on the first call)."""
  with _LOCK:  # lru_cache may run two first calls at once: build and register once
    return _build_and_register() is not None


def _build(compiler: str, path: str) -> bool:
  """Each kernel target's object, then the library with them, into `path`."""
  with tempfile.TemporaryDirectory() as tmp:
    objects = []
    for name, flags in _kernels().items():
      objects.append(os.path.join(tmp, f"kernel_{name}.o"))
      command = [compiler, *_FLAGS, *flags, f"-DKVJAX_ISA={name}", "-c", _SOURCES[1],
                 "-o", objects[-1]]
      if not _run(command):
        return False
    partial = os.path.join(tmp, "qmatmul.so")
    if not _run([compiler, *_FLAGS, "-shared", "-I", jax.ffi.include_dir(), _SOURCES[0],
                 *objects, "-o", partial]):
      return False
    shutil.copyfile(partial, f"{path}.{os.getpid()}")
    os.replace(f"{path}.{os.getpid()}", path)  # atomic: a concurrent builder loads a whole file
  return True


def _run(command) -> bool:
  build = subprocess.run(command, capture_output=True, text=True)
  if build.returncode:
    warnings.warn(f"kvjax qmatmul: could not build ({' '.join(command)}), so quantized "
                  f"weights dequantize for every matmul:\n{build.stderr[-2000:]}")
  return not build.returncode


@functools.lru_cache(maxsize=None)
def _build_and_register():
  """The loaded library (built and registered), or None where qmatmul cannot run."""
  compiler = _compiler()
  if (os.environ.get("KVJAX_QMATMUL") == "0" or jax.default_backend() != "cpu" or
      jax.device_count() != 1 or not compiler):
    return None
  path = _library_path()
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not _build(compiler, path):
      return None
  library = ctypes.CDLL(path)
  library.KvjaxQMatmulSupports.restype = ctypes.c_int64
  library.KvjaxQMatmulSupports.argtypes = [ctypes.c_int64]
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.KvjaxQMatmul), platform="cpu")
  return library


def supported_isas() -> tuple:
  """The ISAS (besides "best") whose kernel runs on this CPU (available() must hold)."""
  library = _build_and_register()
  return tuple(isa for n, isa in enumerate(ISAS) if n and library.KvjaxQMatmulSupports(n))


def _isa_index(isa) -> int:
  isa = isa or os.environ.get("KVJAX_QMATMUL_ISA") or "best"
  if isa not in ISAS:
    raise ValueError(f"qmatmul isa={isa!r} (or $KVJAX_QMATMUL_ISA) is not one of {ISAS}")
  return ISAS.index(isa)


def qmatmul(x: jax.Array, w: QuantizedWeight, isa: str | None = None) -> jax.Array:
  """x [rows, I] @ w viewed as [I, O] -> f32 [rows, O], rows <= MAX_ROWS (available() must
  hold); `isa` one of ISAS (default $KVJAX_QMATMUL_ISA, else "best"); a kernel this CPU
  does not run fails the call."""
  index = _isa_index(isa)
  x = x.astype(jnp.float32)
  if w.in_scale is not None:  # AWQ: row i of the weight is divided by s_i
    x = x / w.in_scale
  offsets = w.offsets if w.offsets is not None else jnp.zeros((0, w.scales.shape[1]),
                                                                jnp.float32)
  out = jax.ShapeDtypeStruct((x.shape[0], w.scales.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out)(x, w.codes, w.scales, offsets,
                                       group=np.int64(w.group_size), bits=np.int64(w.bits),
                                       isa=np.int64(index))
