"""kvjax/weights/gguf_reader.py: GGUFArrayReader's fields are gguf.GGUFReader's, part for
part (the oracle: the upstream reader on the same file), for arrays of every item type,
multi-byte UTF-8 strings and both byte orders."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.constants import GGUFEndian, GGUFValueType as T

from kvjax.weights.gguf_reader import GGUFArrayReader

_ARRAYS = {
    "t.u8": ([0, 7, 255], T.UINT8), "t.i8": ([-128, 5], T.INT8),
    "t.u16": ([700, 65535], T.UINT16), "t.i16": ([-700], T.INT16),
    "t.u32": ([1, 2, 3], T.UINT32), "t.i32": ([-70000, 0], T.INT32),
    "t.f32": ([0.5, -1.25, float("inf")], T.FLOAT32), "t.bool": ([True, False], T.BOOL),
    "t.u64": ([1 << 40], T.UINT64), "t.i64": ([-(1 << 40), 3], T.INT64),
    "t.f64": ([0.25, 1e300], T.FLOAT64),
    "t.strs": (["a", "", "bc", "▁héllo", "<0x0A>", "日本"], T.STRING)}


def _write(path: str, endianess: GGUFEndian) -> None:
  writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
  writer.add_string("t.str", "scalar ✓")
  writer.add_uint32("t.scalar", 9)
  for key, (values, item_type) in _ARRAYS.items():
    writer.add_key_value(key, values, T.ARRAY, sub_type=item_type)
  writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG],
                         ids=["little", "big"])
def test_fields_and_tensors_are_the_upstream_readers(tmp_path, endianess):
  path = str(tmp_path / "arrays.gguf")
  _write(path, endianess)
  ours, upstream = GGUFArrayReader(path), gguf.GGUFReader(path)
  assert list(ours.fields) == list(upstream.fields)
  for key, want in upstream.fields.items():
    got = ours.fields[key]
    assert (got.offset, got.name, got.data, got.types) == \
        (want.offset, want.name, want.data, want.types), key
    assert [(p.dtype, p.shape, p.tobytes()) for p in got.parts] == \
        [(p.dtype, p.shape, p.tobytes()) for p in want.parts], key
    assert got.contents() == want.contents(), key
  assert ours.fields["t.strs"].contents() == _ARRAYS["t.strs"][0]
  assert ours.fields["t.strs"].contents(3) == "▁héllo"
  assert ours.fields["t.i64"].contents(1) == 3
  assert ours.data_offset == upstream.data_offset
  assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == \
      [(t.name, t.tensor_type, t.data.tobytes()) for t in upstream.tensors]


def test_a_string_array_cut_short_is_a_value_error(tmp_path):
  path = tmp_path / "cut.gguf"
  _write(str(path), GGUFEndian.LITTLE)
  data = path.read_bytes()
  cut = data.index("▁héllo".encode()) + 2  # inside t.strs, the metadata's longest array
  path.write_bytes(data[:cut])
  with pytest.raises(ValueError, match="runs past the end of the file"):
    GGUFArrayReader(str(path))
