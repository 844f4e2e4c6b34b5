"""kvjax/quant/qmatmul.py: the custom call that reads a QuantizedWeight's codes, against
numpy float64 products with the weight dequantized in numpy; layers.dense's use of it;
the tied int8 head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.layers import dense
from kvjax.quant import qmatmul
from kvjax.quant.qweight import QuantizedWeight, quantize_weight
from kvjax.weights.quantize import decode_step_weight_bytes, quantize_params



def test_the_kernel_builds_and_registers_here():
  """The suite's machines have g++ (Debian's build-essential): a missing compiler would
  silently send every decode step back to dequantize-then-dot, so it fails here."""
  assert qmatmul.available(), "qmatmul.cc did not build: install g++ (or set $CXX)"


def numpy_dequantize(q: QuantizedWeight) -> np.ndarray:
  """float64 [I, O] from the codes, scales, offsets and in_scale, in numpy alone."""
  codes = np.asarray(q.codes).astype(np.int64)
  if q.bits == 4:  # byte p holds row 2p in its low nibble, row 2p + 1 in its high one
    low = ((codes & 0xF) ^ 8) - 8
    codes = np.stack([low, codes >> 4], axis=1).reshape(-1, codes.shape[1])
  rows = np.arange(codes.shape[0]) // q.group_size
  w = codes * np.asarray(q.scales, np.float64)[rows]
  if q.offsets is not None:
    w = w + np.asarray(q.offsets, np.float64)[rows]
  if q.in_scale is not None:
    w = w / np.asarray(q.in_scale, np.float64)[:, None]
  return w


def f32_tolerance(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """f32 summation error bound of x @ w: a few ulps of sum |x_i w_io| per output."""
  return 1e-6 * np.abs(x) @ np.abs(w) * np.sqrt(x.shape[1]) + 1e-6


# (bits, group, offsets, AWQ in_scale): int8 per channel, GGUF's Q4_1 / Q8_0 blocks as
# int8 and int4 (offsets), int4-g32 / -g128 (a ragged last group at I = 192).
CASES = [(8, None, False, False), (8, 32, True, False), (4, 32, False, False),
         (4, 32, True, False), (4, 128, False, True)]


@pytest.mark.parametrize("bits,group,offsets,awq", CASES)
@pytest.mark.parametrize("rows", [1, 3, 8, qmatmul.MAX_ROWS])
def test_qmatmul_matches_the_dequantized_weight(bits, group, offsets, awq, rows):
  rng = np.random.default_rng(rows * 10 + bits)
  i, o = 192, 200  # 200 = 3 full blocks of 64 columns and a ragged one
  in_scale = jnp.asarray(rng.uniform(0.5, 2.0, i), jnp.float32) if awq else None
  q = quantize_weight(jnp.asarray(rng.standard_normal((i, o)), jnp.float32), num_in=1,
                      bits=bits, group_size=group, in_scale=in_scale)
  if offsets:
    q = q.replace(offsets=jnp.asarray(rng.standard_normal(q.scales.shape), jnp.float32))
  x = rng.standard_normal((rows, i)).astype(np.float32)
  w = numpy_dequantize(q)
  got = np.asarray(jax.jit(qmatmul.qmatmul)(jnp.asarray(x), q), np.float64)
  want = x.astype(np.float64) @ w
  assert np.all(np.abs(got - want) <= f32_tolerance(x, w)), np.abs(got - want).max()


def _hlo(fn, *args) -> str:
  return jax.jit(fn).lower(*args).as_text()


def test_dense_reads_codes_for_decode_rows_and_dequantizes_for_prefill(monkeypatch):
  q = quantize_weight(jnp.ones((64, 4, 16)), num_in=1, bits=4, group_size=32)
  step = lambda x: dense("btd,dnh->btnh", x, q)
  decode, prefill = jnp.ones((2, 4, 64)), jnp.ones((2, qmatmul.MAX_ROWS, 64))
  assert qmatmul.TARGET in _hlo(step, decode)
  assert qmatmul.TARGET not in _hlo(step, prefill)  # 64 rows: XLA's dot of the float weight
  assert "convert" in _hlo(step, prefill)
  monkeypatch.setattr(qmatmul, "available", lambda: False)
  assert qmatmul.TARGET not in _hlo(lambda x: dense("btd,dnh->btnh", x, q), decode)


def _float_params(params):
  """Every QuantizedWeight replaced by its float64 numpy dequantization, cast to f32."""
  def convert(leaf):
    if isinstance(leaf, QuantizedWeight):
      return jnp.asarray(numpy_dequantize(leaf).reshape(leaf.shape), jnp.float32)
    return leaf
  return jax.tree_util.tree_map(convert, params,
                                is_leaf=lambda x: isinstance(x, QuantizedWeight))


@pytest.fixture(scope="module")
def tied_model(tiny_model):
  """The tiny preset with its head tied to the embedding (as SmolLM2's)."""
  cfg = tiny_model.config.replace(tie_word_embeddings=True)
  return kvjax.Model(cfg, tiny_model.params.replace(lm_head=None))


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_quantized_model_logits_match_its_dequantized_float_model(tied_model, scheme):
  """A small random model's logits over 16 tokens (16 rows: every projection and the
  tied int8 head through the custom call) against the same model with every quantized
  weight dequantized in numpy and run in float."""
  cfg = tied_model.config
  params = quantize_params(tied_model.params, cfg, scheme)
  assert tied_model.params.lm_head is None and isinstance(params.lm_head, QuantizedWeight)
  assert params.lm_head.bits == 8 and params.lm_head.scales.shape == (1, cfg.vocab_size)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 16))
  model = kvjax.Model(cfg, params)
  assert qmatmul.TARGET in _hlo(lambda p: kvjax.model.forward(p, cfg, jnp.asarray(tokens)),
                                params)
  got = np.asarray(kvjax.forward(model, tokens))
  want = np.asarray(kvjax.forward(kvjax.Model(cfg, _float_params(params)), tokens))
  scale = np.abs(want).max()
  assert np.abs(got - want).max() < 1e-4 * scale, (np.abs(got - want).max(), scale)
  # The float32 model is within quantization error of both (the head included).
  ref = np.asarray(kvjax.forward(tied_model, tokens))
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (0.05 if scheme == "int8" else 0.3)


def test_tied_head_reads_int8_codes_not_the_float_table(tied_model):
  cfg = tied_model.config
  int8 = quantize_params(tied_model.params, cfg, "int8")
  table = cfg.vocab_size * cfg.hidden_size
  # Read by a step: the head's 4 B a weight of the float table -> 1 B plus a scale per
  # vocabulary row (the table itself is only gathered from).
  float_head = decode_step_weight_bytes(int8.replace(lm_head=None))
  assert decode_step_weight_bytes(int8) == float_head - 4 * table + table + 4 * cfg.vocab_size
