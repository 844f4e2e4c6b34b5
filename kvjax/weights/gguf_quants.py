"""GGUF tensor types decoded exactly in numpy, and their blocks as kvjax QuantizedWeights.

A GGUF tensor is rows of contiguous bytes (a 2-D weight: one row per output
channel, its input elements along the row); a quantized row is a run of blocks.
Every supported block type decodes to integer codes q with one float scale
(and for the affine types one bias) per group of the row:
  Q8_0  32 elements, 34 B: f16 d, 32 int8 q                   w = q d
  Q4_0  32 elements, 18 B: f16 d, 16 B of nibbles, q - 8       w = (q - 8) d
  Q4_1  32 elements, 20 B: f16 d, f16 m, 16 B of nibbles       w = q d + m
  Q5_0  32 elements, 22 B: f16 d, 32 high bits, 16 B nibbles  w = (q - 16) d
  Q5_1  32 elements, 24 B: f16 d, f16 m, high bits, nibbles   w = q d + m
  Q2_K  256 elements, 84 B: 16 B of 4-bit scale / min pairs for 16 groups of 16,
        64 B of 2-bit codes, f16 d, f16 dmin                  w = q (d sc) - dmin mn
  Q3_K  256 elements, 110 B: 32 B high-bit mask, 64 B of 2-bit codes, 12 B of
        16 6-bit scales (- 32), f16 d                         w = (q - 4 [bit off]) (d sc)
  Q4_K  256 elements, 144 B: f16 d, f16 dmin, 12 B of 6-bit scale / min pairs
        for 8 groups of 32, 128 B of nibbles                  w = q (d sc) - dmin mn
  Q5_K  256 elements, 176 B: Q4_K's fields, then 32 B of high bits before the
        nibbles                                               w = q (d sc) - dmin mn
  Q6_K  256 elements, 210 B: 128 B low nibbles, 64 B high 2-bit pairs, 16 int8
        scales for groups of 16, f16 d                        w = (q - 32) (d sc)
(in a 32-element nibble block byte j holds element j low and j + 16 high; Q4_K's
128 nibble bytes are 4 runs of 32 holding groups 2c and 2c + 1; Q6_K's 256
elements are two halves of 128 built from 64 low and 32 high bytes each; a 5-bit
code's high bit for element j of a 32-group is bit j of Q5_0 / Q5_1's little-endian
word, bit g of Q5_K's byte j for group g; Q2_K / Q3_K's 2-bit codes fill 128
elements from 32 bytes, bits 2s..2s+1 of byte j holding element 32s + j, and
Q3_K's mask bit g of byte j belongs to element 32g + j).
F32, F16 and BF16 are plain floats.  `dequantize` computes each product in the
order llama.cpp's reference does, so it equals gguf.quants.dequantize bitwise.

`blocks_qweight` keeps a block type's numbers as a QuantizedWeight under one of
kvjax.weights.quantize's SCHEMES when `maps_blocks` says its codes fit the
scheme's width, with no float round trip: int4-g32 takes Q4_0 (codes q - 8),
Q4_1 and Q4_K (codes q - 8, offset bias + 8 scale); int8 takes those and Q8_0 at
group 32 and Q6_K at group 16 (finer than int8's per-channel scale: the file's
own numbers).  The rest are for the loader to dequantize and quantize with the
scheme itself: Q8_0 and Q6_K to int4, any block type to int4-g64 / int4-g128
(coarser than its 32-element blocks), float tensors to any scheme.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvjax.quant.qweight import QuantizedWeight
from kvjax.quant.symmetric import pack_int4
from kvjax.weights.quantize import SCHEMES

__all__ = ["SUPPORTED_TYPES", "Blocks", "check_type", "decode_blocks", "dequantize",
           "maps_blocks", "blocks_qweight"]

FLOAT_TYPES = ("F32", "F16", "BF16")
# Block type -> (elements per scale, lowest code, highest code) of its decoded q.
_CODES = {"Q8_0": (32, -128, 127), "Q4_0": (32, -8, 7), "Q4_1": (32, 0, 15),
          "Q5_0": (32, -16, 15), "Q5_1": (32, 0, 31), "Q2_K": (16, 0, 3),
          "Q3_K": (16, -4, 3), "Q4_K": (32, 0, 15), "Q5_K": (32, 0, 31),
          "Q6_K": (16, -32, 31)}
SUPPORTED_TYPES = FLOAT_TYPES + tuple(_CODES)


class Blocks(NamedTuple):
  """A quantized tensor's rows as integers: w = q * scale (+ bias), per group."""
  q: np.ndarray  # [rows, elements] int16 codes in _CODES' range
  scale: np.ndarray  # [rows, elements / group] f32
  bias: Optional[np.ndarray]  # [rows, elements / group] f32, None for symmetric types
  group: int


def check_type(type_name: str, tensor: str) -> None:
  if type_name not in SUPPORTED_TYPES:
    raise ValueError(f"GGUF tensor {tensor} has type {type_name}, which kvjax does not "
                     f"decode; supported types: {', '.join(SUPPORTED_TYPES)}")


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
  """[n, 1] f32 from the little-endian f16 at byte `start` of each block."""
  return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
  """Bytes [..., M] -> codes [..., 2M]: every low nibble, then every high one."""
  return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q8_0(b: np.ndarray):
  return b[:, 2:].view(np.int8), _f16(b, 0), None


def _q4_0(b: np.ndarray):
  return _nibbles(b[:, 2:]).astype(np.int16) - 8, _f16(b, 0), None


def _q4_1(b: np.ndarray):
  return _nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2)


def _word_bits(b: np.ndarray, start: int) -> np.ndarray:
  """[n, 32] bit j of the little-endian 32-bit word at byte `start` of each block."""
  word = np.ascontiguousarray(b[:, start:start + 4]).view(np.uint32)  # [n, 1]
  return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b: np.ndarray):
  return (_nibbles(b[:, 6:]) | (_word_bits(b, 2) << 4)).astype(np.int16) - 16, _f16(b, 0), None


def _q5_1(b: np.ndarray):
  return _nibbles(b[:, 8:]) | (_word_bits(b, 4) << 4), _f16(b, 0), _f16(b, 2)


def _crumbs(packed: np.ndarray) -> np.ndarray:
  """2-bit codes: bytes [n, 32 r] -> [n, 128 r], element 32 s + j of each 128 from bits
  2s..2s+1 of its run's byte j."""
  n = packed.shape[0]
  shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
  return ((packed.reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1)


def _mask_bits(mask: np.ndarray) -> np.ndarray:
  """Bytes [n, 32] -> [n, 256]: element 32 g + j is bit g of byte j."""
  n = mask.shape[0]
  shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
  return ((mask.reshape(n, 1, 32) >> shifts) & 1).reshape(n, 256)


def _q2_k(b: np.ndarray):
  scales = b[:, :16]  # group g: scale in the low nibble, min in the high one
  scale = _f16(b, 80) * (scales & 0x0F).astype(np.float32)
  return _crumbs(b[:, 16:80]), scale, -(_f16(b, 82) * (scales >> 4).astype(np.float32))


def _q3_k(b: np.ndarray):
  n = b.shape[0]
  packed = b[:, 96:108]  # 16 6-bit scales: low nibbles in 0-7, high pairs in 8-11
  low = _nibbles(packed[:, :8])
  high = (packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8)
          .reshape(1, 4, 1)).reshape(n, 16) & 0x03
  sc = (low | (high << 4)).astype(np.int16) - 32
  q = _crumbs(b[:, 32:96]).astype(np.int16) - 4 * (1 - _mask_bits(b[:, :32]).astype(np.int16))
  return q, _f16(b, 108) * sc.astype(np.float32), None


def _k_scales(b: np.ndarray):
  """Q4_K / Q5_K: (d sc [n, 8], -(dmin mn) [n, 8]) from the 12 bytes at 4..15."""
  packed = b[:, 4:16]  # 8 6-bit scales and 8 6-bit mins
  lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
  sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
  mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
  return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * mn.astype(np.float32))


def _q4_k(b: np.ndarray):
  n = b.shape[0]
  q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 256)
  return (q, *_k_scales(b))


def _q5_k(b: np.ndarray):
  n = b.shape[0]
  q = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 256) | (_mask_bits(b[:, 16:48]) << 4)
  return (q, *_k_scales(b))


def _q6_k(b: np.ndarray):
  n = b.shape[0]
  low = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
  shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
  high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03  # [n, halves, 4, 32]
  q = (low | (high << 4)).reshape(n, 256).astype(np.int16) - 32
  scale = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
  return q, scale, None


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
             "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def decode_blocks(raw: np.ndarray, type_name: str) -> Blocks:
  """raw uint8 [rows, bytes per row] of a block type -> its Blocks."""
  _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
  rows = raw.shape[0]
  blocks = np.ascontiguousarray(raw, np.uint8).reshape(-1, type_size)
  q, scale, bias = _DECODERS[type_name](blocks)
  flat = lambda x: None if x is None else x.reshape(rows, -1)
  return Blocks(flat(q).astype(np.int16), flat(scale), flat(bias), _CODES[type_name][0])


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
  """A GGUF tensor's stored rows (as gguf.GGUFReader gives them: [..., bytes or
  elements per row]) -> float32 [..., elements per row]."""
  check_type(type_name, "data")
  if type_name == "F32":
    return np.asarray(raw).view(np.float32)
  if type_name == "F16":
    return np.asarray(raw).view(np.float16).astype(np.float32)
  raw = np.asarray(raw).view(np.uint8)
  lead = raw.shape[:-1]
  rows = raw.reshape(-1, raw.shape[-1])
  if type_name == "BF16":
    w = (np.ascontiguousarray(rows).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return w.reshape(*lead, -1)
  b = decode_blocks(rows, type_name)
  n = b.q.shape[0]
  w = b.q.reshape(n, -1, b.group).astype(np.float32) * b.scale[..., None]
  if b.bias is not None:
    w = w + b.bias[..., None]
  return w.reshape(*lead, -1)


def _code_shift(type_name: str, bits: int) -> int:
  """s with q + s in the signed `bits` range (0 when q's range already is)."""
  _, low, high = _CODES[type_name]
  top = 2 ** (bits - 1)
  return 0 if (low >= -top and high < top) else -top - low


def maps_blocks(type_name: str, scheme: str) -> bool:
  """Whether `type_name`'s blocks are a QuantizedWeight under `scheme` as they stand:
  codes that fit its width (after a shift), scales at its group (int8: any group)."""
  if type_name not in _CODES:
    return False
  bits, group = SCHEMES[scheme]
  block_group, low, high = _CODES[type_name]
  return high - low < 2 ** bits and group in (None, block_group)


def blocks_qweight(raw: np.ndarray, type_name: str, scheme: str, shape: tuple,
                   num_in: int) -> QuantizedWeight:
  """A 2-D GGUF weight's rows raw [O, bytes per row] (O outputs, I inputs along each
  row) -> the QuantizedWeight of kvjax shape [*in, *out] (prod(in) = I) holding its
  blocks' numbers under `scheme` (maps_blocks must hold): w = (q + s) scale + (bias
  - s scale) for the code shift s."""
  if not maps_blocks(type_name, scheme):
    raise ValueError(f"GGUF {type_name} blocks do not fit the {scheme} scheme; dequantize "
                     "and quantize instead")
  bits, _ = SCHEMES[scheme]
  b = decode_blocks(raw, type_name)
  shift = _code_shift(type_name, bits)
  codes = (b.q + shift).astype(np.int8)  # [O, I]
  offsets = b.bias  # [O, I / group]
  if shift:
    offsets = (0 if b.bias is None else b.bias) - np.float32(shift) * b.scale
  packed = pack_int4(jnp.asarray(codes)).T if bits == 4 else jnp.asarray(codes.T)
  return QuantizedWeight(
      codes=packed, scales=jnp.asarray(b.scale.T),
      offsets=None if offsets is None else jnp.asarray(offsets.T, jnp.float32),
      shape=tuple(shape), num_in=num_in, bits=bits, group_size=b.group)
