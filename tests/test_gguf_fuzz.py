"""GGUF header fuzzer: a tiny GGUF file (tests/test_gguf.py's write_tiny_gguf, with one
metadata key of every value type) with one header field mutated per case: the version,
the counts, every key's length, type code and value, every string's length and bytes,
every array's item type and length, every tensor's name, n_dims, dims, type and offset,
and cuts of the file.  The only allowed outcomes are a load or a ValueError that names
the field (its key, tensor or count, or the field right before a shifted one), each in
< 5 s and < 2 GB.

The oracle for where each field sits is this file's own walk of the well-formed file
(GGUF's layout: u64 lengths and counts, u32 type codes, little-endian)."""
from __future__ import annotations

import random
import resource
import signal
import struct
import time

import pytest
from gguf.constants import GGMLQuantizationType, GGUFValueType as T

import kvjax
from tests.test_gguf import write_tiny_gguf

SEED = 53
CASES = 600  # of the ~2,500 mutations (all of them: 50 s on 2 busy cores, all pass)
_EXTRA = {  # one key of every value type, beyond what the loader reads
    "fuzz.u8": (7, T.UINT8), "fuzz.i8": (-7, T.INT8), "fuzz.u16": (700, T.UINT16),
    "fuzz.i16": (-700, T.INT16), "fuzz.i32": (-70000, T.INT32), "fuzz.f32": (0.5, T.FLOAT32),
    "fuzz.bool": (True, T.BOOL), "fuzz.str": ("kvjax", T.STRING),
    "fuzz.u64": (1 << 40, T.UINT64), "fuzz.i64": (-(1 << 40), T.INT64),
    "fuzz.f64": (0.25, T.FLOAT64), "fuzz.strs": (["a", "bc", ""], T.ARRAY, T.STRING),
    "fuzz.ints": ([1, 2, 3], T.ARRAY, T.INT32)}
_SCALAR = {T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I",
           T.INT32: "i", T.FLOAT32: "f", T.BOOL: "?", T.UINT64: "Q", T.INT64: "q",
           T.FLOAT64: "d"}
_U64S = (0, 1, 2 ** 31, 2 ** 40, 2 ** 63, 2 ** 64 - 1)
_FLOATS = (float("nan"), float("inf"), -1.0, 0.0, 1e30)


def _u32(value: int) -> bytes:
  return struct.pack("<I", value % 2 ** 32)


def _u64(value: int) -> bytes:
  return struct.pack("<Q", value % 2 ** 64)


def _strings(raw: bytes) -> list:
  """The strings of a GGUF string array's items (u64 length, bytes)."""
  out, pos = [], 0
  while pos < len(raw):
    n, = struct.unpack_from("<Q", raw, pos)
    out.append(raw[pos + 8:pos + 8 + n].decode())
    pos += 8 + n
  return out


def _mutations(data: bytes) -> list:
  """[(label, names any of which the error may give, patches [(offset, bytes)] or a cut
  length)] for every field of the well-formed file `data`."""
  out, pos = [], 24
  tensor_count, kv_count = struct.unpack_from("<QQ", data, 8)
  keys, tensors = [], []

  def patch(label, names, offset, raw):
    out.append((label, names, [(offset, raw)]))

  def u64_field(label, names, offset, value):
    for v in sorted({*_U64S, value + 1, max(0, value - 1), len(data)}):
      patch(f"{label}={v}", names, offset, _u64(v))

  def string(label, names):
    nonlocal pos
    n, = struct.unpack_from("<Q", data, pos)
    u64_field(f"{label} length", names, pos, n)
    if n:
      patch(f"{label} not UTF-8", names, pos + 8, b"\xff")
    pos += 8 + n
    return data[pos - n:pos].decode()

  def value(label, names, kind):
    nonlocal pos
    if kind == T.STRING:
      string(f"{label} string", names)
    elif kind == T.ARRAY:
      head = pos
      item, n = struct.unpack_from("<IQ", data, pos)
      pos += 12
      for i in range(n):
        value(f"{label}[{i}]", names, T(item))
      # another length or item type reads the items as the fields after the array: the
      # first that fails may be a string item read as a key, which the error then names
      shifted = names + _strings(data[head + 12:pos]) * (item == T.STRING)
      for code in (*range(13), 13, 2 ** 32 - 1):
        patch(f"{label} item type={code}", shifted, head, _u32(code))
      u64_field(f"{label} array length", shifted, head + 4, n)
    else:
      code = _SCALAR[kind]
      size = struct.calcsize(code)
      extremes = _FLOATS if code in "fd" else (0, 2 ** (8 * size) - 1, 2 ** (8 * size - 1))
      for v in extremes:
        raw = struct.pack("<" + code, v) if code in "fd" else v.to_bytes(size, "little")
        patch(f"{label}={v}", names, pos, raw)
      pos += size

  for _ in range(kv_count):
    start = pos
    key = string("key", ["kv_count", *keys[-1:]])
    keys.append(key)
    names = [key]
    kind, = struct.unpack_from("<I", data, pos)
    for code in (*range(13), 13, 2 ** 32 - 1):
      patch(f"{key} type={code}", names, pos, _u32(code))
    pos += 4
    value(key, names, T(kind))
    out.append((f"cut in {key}", ["kv_count", "tensor_count", key, *keys[-2:-1]],
                (start + pos) // 2))
  for _ in range(tensor_count):
    start = pos
    name = string("tensor name", ["tensor_count", *tensors[-1:]])
    tensors.append(name)
    names = [name]
    n_dims, = struct.unpack_from("<I", data, pos)
    for v in (0, n_dims - 1, n_dims + 1, 5, 2 ** 32 - 1):
      patch(f"{name} n_dims={v}", names, pos, _u32(v))
    pos += 4
    for d in range(n_dims):
      dim, = struct.unpack_from("<Q", data, pos)
      u64_field(f"{name} dim {d}", names, pos, dim)
      patch(f"{name} dim {d} doubled", names, pos, _u64(2 * dim))
      pos += 8
    for code in (*(int(t) for t in GGMLQuantizationType), 4, 99, 2 ** 32 - 1):
      patch(f"{name} type={code}", names, pos, _u32(code))
    pos += 4
    offset, = struct.unpack_from("<Q", data, pos)
    u64_field(f"{name} offset", names, pos, offset)
    pos += 8
    out.append((f"cut in {name}", ["tensor_count", name, *tensors[-2:-1]], (start + pos) // 2))
  header = ["tensor_count", "kv_count", *keys, *tensors]
  u64_field("tensor_count", ["tensor_count", *tensors], 8, tensor_count)
  u64_field("kv_count", ["kv_count", *keys, *tensors], 16, kv_count)  # more: infos as keys
  for v in (0, 1, 4, 2 ** 32 - 1):
    patch(f"version={v}", ["version"], 4, _u32(v))
  out.append(("no magic", ["magic"], [(0, b"GGUG")]))
  for cut in (0, 3, 8, 20, pos, len(data) - 1):
    out.append((f"cut at {cut}", ["magic", "version", *header], cut))
  return out


def _too_slow(_signum, _frame):
  raise TimeoutError("a case ran past 5 s")


def _mutated(data: bytes, change) -> bytes:
  if isinstance(change, int):
    return data[:change]
  buf = bytearray(data)
  for offset, raw in change:
    buf[offset:offset + len(raw)] = raw
  return bytes(buf)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
  path = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
  write_tiny_gguf(str(path), "llama", "Q8_0", metadata=_EXTRA)
  return path.read_bytes()


def test_every_mutation_loads_or_names_its_field(tiny_gguf, tmp_path):
  cases = _mutations(tiny_gguf)
  assert len(cases) > 1000
  sampled = random.Random(SEED).sample(cases, CASES)
  signal.signal(signal.SIGALRM, _too_slow)
  rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  wrong, loaded = [], 0
  for i, (label, names, change) in enumerate(sampled):
    path = str(tmp_path / f"case-{i}.gguf")
    with open(path, "wb") as f:
      f.write(_mutated(tiny_gguf, change))
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
      kvjax.load_checkpoint(path)
      loaded += 1
    except ValueError as e:
      if not any(name in str(e) for name in names):
        wrong.append(f"{label}: ValueError naming none of {names[:4]}: {str(e)[:300]}")
    except Exception as e:  # noqa: BLE001 -- any other kind is what the fuzzer reports
      wrong.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
    seconds = time.monotonic() - start
    if seconds > 5:
      wrong.append(f"{label}: took {seconds:.1f} s")
  grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_start
  assert not wrong, f"{len(wrong)} of {CASES}:\n" + "\n".join(wrong)
  assert 0 < loaded < CASES  # both outcomes were reached
  assert grown < 2 ** 31


def _patched(tiny_gguf: bytes, tmp_path, key: bytes, skip: int, raw: bytes) -> str:
  """The file with `raw` written `skip` bytes after the end of metadata key `key`."""
  at = tiny_gguf.index(key) + len(key) + skip
  path = str(tmp_path / "patched.gguf")
  with open(path, "wb") as f:
    f.write(tiny_gguf[:at] + raw + tiny_gguf[at + len(raw):])
  return path


def test_an_array_longer_than_the_file_is_refused_at_once(tiny_gguf, tmp_path):
  # fuzz.ints: value type (4 bytes), item type (4 bytes), then the u64 length: 2^40 int32
  # items, which gguf.GGUFReader reads one empty view at a time past the end (hours)
  path = _patched(tiny_gguf, tmp_path, b"fuzz.ints", 8, _u64(2 ** 40))
  start = time.monotonic()
  with pytest.raises(ValueError, match="'fuzz.ints'.*array length 1099511627776 cannot fit"):
    kvjax.load_checkpoint(path)
  assert time.monotonic() - start < 1


def test_a_size_no_tensor_has_is_named_before_the_fit_check(tiny_gguf, tmp_path):
  # llama.feed_forward_length: value type (4 bytes), then the uint32 value
  path = _patched(tiny_gguf, tmp_path, b"llama.feed_forward_length", 4, _u32(2 ** 31))
  with pytest.raises(ValueError, match="llama.feed_forward_length = 2147483648 disagrees "
                                       "with tensor blk.0.ffn_up.weight"):
    kvjax.load_checkpoint(path)
