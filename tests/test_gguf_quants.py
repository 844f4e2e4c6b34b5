"""GGUF tensor decoding against the gguf package, and GGUF blocks as QuantizedWeights.

Oracle: gguf.quants.dequantize (llama.cpp's reference formulas in numpy) for every
decoded value, bitwise; numpy float64 for QuantizedWeight's offsets.  Bytes come
from gguf.quants.quantize where it implements the type, else (the K types) random
bytes with finite f16 scales.
"""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvjax.parallel import sharding
from kvjax.quant.qweight import QuantizedWeight
from kvjax.weights import gguf_quants
from kvjax.weights.quantize import weight_bytes

# Byte offsets of each block's f16 scales, for the types gguf cannot quantize.
_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}


def gguf_bytes(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
  """A [rows, cols] tensor stored as `type_name`: rows as gguf.GGUFReader gives them."""
  rng = np.random.default_rng(seed)
  qtype = GGMLQuantizationType[type_name]
  if type_name in _F16_FIELDS:
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for start in _F16_FIELDS[type_name]:
      scale = (rng.normal(size=(blocks.shape[0], 1)) * 0.05).astype(np.float16)
      blocks[:, start:start + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)
  return gguf.quants.quantize(rng.normal(size=(rows, cols)).astype(np.float32), qtype)


def reference(raw: np.ndarray, type_name: str) -> np.ndarray:
  return gguf.quants.dequantize(raw, GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", gguf_quants.SUPPORTED_TYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_dequantize_equals_gguf_bitwise(type_name, rows):
  raw = gguf_bytes(type_name, rows, 768, seed=rows)
  ours, ref = gguf_quants.dequantize(raw, type_name), reference(raw, type_name)
  assert ours.dtype == np.float32 and ours.shape == ref.shape == (rows, 768)
  np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_dequantize_one_dimensional_tensor():
  raw = gguf_bytes("Q8_0", 1, 64)[0]  # a vector's bytes [34 * 2]
  np.testing.assert_array_equal(gguf_quants.dequantize(raw, "Q8_0"), reference(raw, "Q8_0"))


def test_unsupported_type_names_it_and_lists_supported():
  with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight has type IQ4_XS.*Q5_K"):
    gguf_quants.check_type("IQ4_XS", "blk.0.ffn_up.weight")


# (type, scheme) -> (bits, group, offsets kept) where the file's blocks map without
# requantizing; the loader requantizes the rest (tests/test_gguf.py checks that).
_MAPPED = {("Q8_0", "int8"): (8, 32, False), ("Q4_0", "int8"): (8, 32, False),
           ("Q4_1", "int8"): (8, 32, True), ("Q4_K", "int8"): (8, 32, True),
           ("Q6_K", "int8"): (8, 16, False), ("Q5_0", "int8"): (8, 32, False),
           ("Q5_1", "int8"): (8, 32, True), ("Q5_K", "int8"): (8, 32, True),
           ("Q2_K", "int8"): (8, 16, True), ("Q3_K", "int8"): (8, 16, False),
           ("Q4_0", "int4-g32"): (4, 32, False),
           ("Q4_1", "int4-g32"): (4, 32, True), ("Q4_K", "int4-g32"): (4, 32, True)}


@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "int4-g64"])
@pytest.mark.parametrize("type_name", gguf_quants.SUPPORTED_TYPES)
def test_blocks_kept_as_quantized_weight(type_name, scheme):
  rows, cols = 6, 512  # O = 6 outputs (3 heads x 2), I = 512 inputs
  mapped = _MAPPED.get((type_name, scheme))
  assert gguf_quants.maps_blocks(type_name, scheme) == (mapped is not None)
  raw = gguf_bytes(type_name, rows, cols, seed=3)
  if mapped is None:
    with pytest.raises(ValueError, match=f"{type_name} blocks do not fit the {scheme}"):
      gguf_quants.blocks_qweight(raw, type_name, scheme, (cols, 3, 2), 1)
    return
  ref = reference(raw, type_name).T.reshape(cols, 3, 2)  # [I, O] as [D, N, H]
  w = gguf_quants.blocks_qweight(raw, type_name, scheme, (cols, 3, 2), 1)
  bits, group, has_offsets = mapped
  assert (w.shape, w.num_in) == ((cols, 3, 2), 1)
  assert (w.bits, w.group_size, w.offsets is not None) == mapped
  assert w.codes.dtype == jnp.int8 and w.codes.shape == (cols * bits // 8, rows)
  got = np.asarray(w.dequantize(jnp.float32))
  # Same numbers: codes times the file's scale, exactly; a shifted zero point only
  # reorders one f32 addition (Q4_1: (q - 8) d + (m + 8d) for q d + m).
  np.testing.assert_allclose(got, ref, rtol=0, atol=2e-7 * np.abs(ref).max())
  if not has_offsets:
    np.testing.assert_array_equal(got, ref)


def test_q8_0_maps_to_int8_exactly():
  """A hand-made Q8_0 tensor: codes are its int8 bytes, scales its f16 d, group 32."""
  rng = np.random.default_rng(5)
  rows, cols = 3, 64
  d = np.array([0.5, 0.03125, 2.0], np.float16)  # per row; one scale for both blocks
  q = rng.integers(-127, 128, size=(rows, cols)).astype(np.int8)
  blocks = np.concatenate([np.repeat(d, 2)[:, None].view(np.uint8),
                           q.reshape(rows * 2, 32).view(np.uint8)], axis=1)
  raw = blocks.reshape(rows, -1)  # [3, 68]
  w = gguf_quants.blocks_qweight(raw, "Q8_0", "int8", (cols, rows), 1)
  np.testing.assert_array_equal(np.asarray(w.codes), q.T)
  np.testing.assert_array_equal(np.asarray(w.scales), np.repeat(d[None], 2, 0).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(w.dequantize(jnp.float32)),
                                q.T.astype(np.float32) * d.astype(np.float32))


def test_int4_codes_packed_even_input_low_nibble():
  """The mapped int4 codes, unpacked here in numpy: byte [i, o] holds input 2i in its
  low nibble and 2i + 1 in its high one (kvjax pack_int4), both sign-extended."""
  raw = gguf_bytes("Q4_0", 4, 64, seed=9)
  w = gguf_quants.blocks_qweight(raw, "Q4_0", "int4-g32", (64, 4), 1)
  packed = np.asarray(w.codes).astype(np.int16)  # [32, 4]
  low = ((packed & 0xF) ^ 8) - 8
  high = packed >> 4
  codes = np.stack([low, high], axis=1).reshape(64, 4)
  blocks = raw.reshape(8, 18)
  d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [8 blocks, 1]
  nibbles = np.concatenate([blocks[:, 2:] & 0xF, blocks[:, 2:] >> 4], axis=1)  # [8, 32]
  np.testing.assert_array_equal(codes, (nibbles.astype(np.int16) - 8).reshape(4, 64).T)
  np.testing.assert_array_equal(np.asarray(w.scales), d.reshape(4, 2).T)


@pytest.fixture(scope="module")
def affine_weight():
  """A QuantizedWeight with offsets, a ragged last group (I = 40, group 16) and AWQ
  in_scale; its float64 value computed here in numpy."""
  rng = np.random.default_rng(11)
  rows, cols, group = 40, 6, 16
  codes = rng.integers(-8, 8, size=(rows, cols)).astype(np.int8)
  scales = rng.uniform(0.01, 0.1, size=(3, cols)).astype(np.float32)
  offsets = rng.normal(size=(3, cols)).astype(np.float32)
  in_scale = rng.uniform(0.5, 2.0, size=(rows,)).astype(np.float32)
  w = QuantizedWeight(codes=jnp.asarray(codes), scales=jnp.asarray(scales),
                      offsets=jnp.asarray(offsets), in_scale=jnp.asarray(in_scale),
                      shape=(rows, 2, 3), num_in=1, bits=8, group_size=group)
  g = np.arange(rows) // group
  want = (codes * scales[g].astype(np.float64) + offsets[g]) / in_scale[:, None]
  return w, want.reshape(rows, 2, 3)


def test_offsets_dequantize(affine_weight):
  w, want = affine_weight
  np.testing.assert_allclose(np.asarray(w.dequantize(jnp.float32)), want, rtol=1e-6, atol=1e-6)
  assert w.nbytes == 40 * 6 + 4 * (3 * 6 + 3 * 6 + 40)  # codes, scales, offsets, in_scale
  assert weight_bytes(w) == w.nbytes


def test_offsets_survive_jit_and_sharding(affine_weight):
  w, want = affine_weight
  mesh = sharding.make_mesh(tp=1)
  placed = sharding.shard_params(w, mesh)
  assert placed.offsets is not None
  got = jax.jit(lambda q: q.dequantize(jnp.float32))(placed)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
