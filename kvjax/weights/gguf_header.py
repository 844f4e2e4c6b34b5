"""A GGUF file's header walked and bounded before gguf.GGUFReader parses it.

The reader trusts every count in the file: an array whose item count is past what the
file holds loops item by item past the end (2^40 uint32 items: hours, each read an
empty view), and a tensor's dims or offset past the file surface later as a numpy
reshape error naming nothing.  `check_gguf_header` reads each count, length, type code,
dim and offset once, refuses any the file's size cannot hold before anything is read
or allocated by it, and names the field: the metadata key or tensor, with its index,
and the one before it (a wrong type or length shifts every later field, so the first
field that no longer parses sits right after the damaged one).
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Optional

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["check_gguf_header"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # gguf.GGUFReader's READER_SUPPORTED_VERSIONS
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_STRING_BYTES = 8  # the least a string takes: its u64 length
_KEY_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_TENSOR_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset (no dims)
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_ALIGNMENT = 32  # GGUF's default, else general.alignment
_MAX_NAME = 63  # ggml's GGML_MAX_NAME (64) less its NUL: llama.cpp refuses longer names


class _Cursor:
  """Bounded little- or big-endian reads from the file's bytes; `field` names what is
  being read, for the errors."""

  def __init__(self, data, where: str):
    self.data, self.where, self.pos, self.order = data, where, 0, "<"
    self.field = "the header"

  def fail(self, what: str) -> ValueError:
    return ValueError(f"{self.where}: {self.field}: {what}")

  def left(self) -> int:
    return len(self.data) - self.pos

  def take(self, size: int, what: str) -> bytes:
    if size > self.left():
      raise self.fail(f"{what} ({size} bytes at byte {self.pos}) runs past the end of the "
                      f"file ({len(self.data)} bytes)")
    self.pos += size
    return self.data[self.pos - size:self.pos]

  def scalar(self, code: str, what: str):
    return struct.unpack(self.order + code, self.take(struct.calcsize(code), what))[0]

  def count(self, what: str, item_bytes: int) -> int:
    """A u64 count of items of at least `item_bytes` each, bounded by the bytes left."""
    n = self.scalar("Q", what)
    if n * item_bytes > self.left():
      raise self.fail(f"{what} {n} cannot fit in the {self.left()} bytes left of the file")
    return n

  def name(self, what: str, longest: Optional[int] = None) -> str:
    """A key or tensor name: printable ASCII as GGUF's spec has them, so that a field
    shifted by a damaged one before it fails here, next to the damage."""
    name = self.string(what)
    if not (name and name.isascii() and name.isprintable()) or \
        (longest is not None and len(name) > longest):
      longer = "" if longest is None else f" of at most {longest} characters"
      raise self.fail(f"{what} {name[:80]!r} is no printable ASCII name{longer}")
    return name

  def string(self, what: str) -> str:
    raw = self.take(self.count(f"{what} length", 1), what)
    try:
      return raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise self.fail(f"{what} is not UTF-8 ({e})") from None


def _value_type(cursor: _Cursor, code: int, what: str) -> GGUFValueType:
  try:
    return GGUFValueType(code)
  except ValueError:
    raise cursor.fail(f"{what} {code} is no GGUF value type") from None


def _item_bytes(kind: GGUFValueType) -> int:
  return _STRING_BYTES if kind == GGUFValueType.STRING else struct.calcsize(_SCALARS[kind])


def _skip_value(cursor: _Cursor, kind: GGUFValueType):
  """Past one value of `kind`; -> a scalar's value (None for strings and arrays)."""
  if kind == GGUFValueType.STRING:
    cursor.string("string value")
    return None
  if kind != GGUFValueType.ARRAY:
    return cursor.scalar(_SCALARS[kind], "value")
  item = _value_type(cursor, cursor.scalar("I", "array item type"), "array item type")
  if item == GGUFValueType.ARRAY:
    raise cursor.fail("an array of arrays is unsupported")
  for _ in range(cursor.count("array length", _item_bytes(item))):
    _skip_value(cursor, item)
  return None


def _check_metadata(cursor: _Cursor, kv_count: int) -> tuple[int, str]:
  """Every key and value; -> (the tensor data's alignment, the last key)."""
  alignment, seen, previous = _ALIGNMENT, set(), ""
  for i in range(kv_count):
    cursor.field = f"metadata key #{i} of kv_count {kv_count}{previous}"
    key = cursor.name("key")
    cursor.field = f"metadata key {key!r} (#{i} of kv_count {kv_count})"
    if key in seen:
      raise cursor.fail("the key is given twice")
    seen.add(key)
    kind = _value_type(cursor, cursor.scalar("I", "value type"), "value type")
    value = _skip_value(cursor, kind)
    if key == "general.alignment":
      if kind != GGUFValueType.UINT32 or value < 1 or value & (value - 1):
        raise cursor.fail(f"must be a uint32 power of two, got {kind.name} {value!r}")
      alignment = value
    previous = f" (after {key!r})"
  return alignment, previous


def _check_tensor_infos(cursor: _Cursor, tensor_count: int, previous: str) -> list:
  """Every tensor's name, dims and type (`previous`: the field before the first, a
  metadata key); -> [(field name, bytes, offset)]."""
  infos, seen = [], set()
  for i in range(tensor_count):
    cursor.field = f"tensor #{i} of tensor_count {tensor_count}{previous}"
    name = cursor.name("name", _MAX_NAME)
    cursor.field = f"tensor {name!r} (#{i} of tensor_count {tensor_count})"
    if name in seen:
      raise cursor.fail("the name is given twice")
    seen.add(name)
    n_dims = cursor.scalar("I", "n_dims")
    if not 1 <= n_dims <= _MAX_DIMS:
      raise cursor.fail(f"n_dims must be in [1, {_MAX_DIMS}], got {n_dims}")
    dims = [cursor.scalar("Q", f"dim {d}") for d in range(n_dims)]
    code = cursor.scalar("I", "type")
    try:
      kind = GGMLQuantizationType(code)
      block, block_bytes = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
      raise cursor.fail(f"type {code} is no ggml tensor type") from None
    if dims[0] % block:
      raise cursor.fail(f"dim 0 ({dims[0]}) is not a multiple of {kind.name}'s block of "
                        f"{block}")
    elements = 1
    for dim in dims:
      elements *= dim  # a Python int: no overflow however large the dims
    infos.append((cursor.field, elements // block * block_bytes,
                  cursor.scalar("Q", "offset")))
    previous = f" (after {name!r})"
  return infos


def check_gguf_header(path: str) -> None:
  """ValueError naming the first count, length, type, dim or offset of the GGUF file at
  `path` that the file cannot hold or gguf.GGUFReader cannot parse (module doc)."""
  if os.path.getsize(path) < 4:
    raise ValueError(f"GGUF file {path}: {os.path.getsize(path)} bytes hold no GGUF magic")
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
    cursor = _Cursor(data, f"GGUF file {path}")
    if cursor.take(4, "magic") != _MAGIC:
      raise cursor.fail("no GGUF magic")
    version = cursor.scalar("I", "version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
      cursor.order = ">"
      version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in _VERSIONS:
      raise cursor.fail(f"version {version} is unsupported (supported: {_VERSIONS})")
    tensor_count = cursor.count("tensor_count", _TENSOR_BYTES)
    kv_count = cursor.count("kv_count", _KEY_BYTES)
    alignment, last_key = _check_metadata(cursor, kv_count)
    infos = _check_tensor_infos(cursor, tensor_count, last_key)
    start = -(-cursor.pos // alignment) * alignment
    for field, size, offset in infos:
      if start + offset + size > len(data):
        raise ValueError(f"{cursor.where}: {field}: its {size} bytes at data offset "
                         f"{offset} run past the end of the file ({len(data)} bytes)")
