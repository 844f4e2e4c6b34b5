"""kvjax/quant/qmatmul.py: the custom call that reads a QuantizedWeight's codes, against
numpy float64 products with the weight dequantized in numpy; layers.dense's use of it;
the tied int8 head."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.model.layers import dense
from kvjax.quant import qmatmul
from kvjax.quant.qweight import QuantizedWeight, quantize_weight
from kvjax.weights import gguf_quants
from kvjax.weights.quantize import decode_step_weight_bytes, quantize_params
from tests.test_gguf_quants import gguf_bytes, reference as gguf_reference



def test_the_kernel_builds_and_registers_here():
  """The suite's machines have g++ (Debian's build-essential): a missing compiler would
  silently send every decode step back to dequantize-then-dot, so it fails here."""
  assert qmatmul.available(), "qmatmul.cc did not build: install g++ (or set $CXX)"


def numpy_codes(q: QuantizedWeight) -> np.ndarray:
  """int64 [I, O] signed codes, the int4 nibbles unpacked, in numpy alone."""
  codes = np.asarray(q.codes).astype(np.int64)
  if q.bits == 4:  # byte p holds row 2p in its low nibble, row 2p + 1 in its high one
    low = ((codes & 0xF) ^ 8) - 8
    codes = np.stack([low, codes >> 4], axis=1).reshape(-1, codes.shape[1])
  return codes


def numpy_group_rows(q: QuantizedWeight, name: str) -> np.ndarray:
  """float64 [I, O]: q's scales or offsets repeated over each group's input rows."""
  rows = np.arange(numpy_codes(q).shape[0]) // q.group_size
  return np.asarray(getattr(q, name), np.float64)[rows]


def numpy_dequantize(q: QuantizedWeight) -> np.ndarray:
  """float64 [I, O] from the codes, scales, offsets and in_scale, in numpy alone."""
  w = numpy_codes(q) * numpy_group_rows(q, "scales")
  if q.offsets is not None:
    w = w + numpy_group_rows(q, "offsets")
  if q.in_scale is not None:
    w = w / np.asarray(q.in_scale, np.float64)[:, None]
  return w


def f32_tolerance(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """f32 summation error bound of x @ w: a few ulps of sum |x_i w_io| per output."""
  return 1e-6 * np.abs(x) @ np.abs(w) * np.sqrt(x.shape[1]) + 1e-6


def numpy_activation_blocks(size: int, group: int) -> list:
  """qmatmul's activation blocks [begin, end): ACTIVATION_BLOCK rows at a time inside
  each weight group (the last of each ragged)."""
  step = qmatmul.ACTIVATION_BLOCK
  return [(b, min(b + step, g + group, size)) for g in range(0, size, group)
          for b in range(g, min(g + group, size), step)]


def numpy_quantize_activations(x: np.ndarray, blocks: list):
  """f32 x -> (its int8 codes, each input's block scale), rounded in f32 as the doc of
  qmatmul.cc says: scale = max |x| / 127, code = rint(x * (127 / max |x|))."""
  codes, scales = np.zeros_like(x), np.zeros_like(x)
  for b, e in blocks:
    top = np.abs(x[:, b:e]).max(1, keepdims=True)
    inverse = np.float32(127) / np.where(top == 0, np.float32(1), top)
    codes[:, b:e] = np.where(top == 0, 0, np.rint(x[:, b:e] * inverse))
    scales[:, b:e] = top / np.float32(127)
  return codes, scales


# (bits, group, offsets, AWQ in_scale): int8 per channel, GGUF's Q4_1 / Q8_0 blocks as
# int8 and int4 (offsets), int4-g32 / -g128 (a ragged last group at I = 192), int8 in
# groups of 40 (blocks of 32 and 8 rows: the 4-row units' ragged tails), int8 in
# groups of 16 with offsets (Q6_K's blocks).
CASES = [(8, None, False, False), (8, 32, True, False), (4, 32, False, False),
         (4, 32, True, False), (4, 128, False, True), (8, 40, False, False),
         (8, 16, True, False)]


def _case(bits, group, offsets, awq, rows):
  """(q, x) with random codes, scales, offsets: x [rows, 192] @ q [192, 200] (3 full
  blocks of 64 columns and a ragged one)."""
  rng = np.random.default_rng(rows * 10 + bits)
  i, o = 192, 200
  in_scale = jnp.asarray(rng.uniform(0.5, 2.0, i), jnp.float32) if awq else None
  q = quantize_weight(jnp.asarray(rng.standard_normal((i, o)), jnp.float32), num_in=1,
                      bits=bits, group_size=group, in_scale=in_scale)
  if offsets:
    q = q.replace(offsets=jnp.asarray(rng.standard_normal(q.scales.shape), jnp.float32))
  return q, rng.standard_normal((rows, i)).astype(np.float32)


def _kernel_input(x: np.ndarray, q: QuantizedWeight) -> np.ndarray:
  """x as the kernel gets it: divided by AWQ's in_scale in f32, as qmatmul() does."""
  return x if q.in_scale is None else x / np.asarray(q.in_scale)


@pytest.mark.parametrize("bits,group,offsets,awq", CASES)
@pytest.mark.parametrize("rows", [1, 3, 8, qmatmul.MAX_ROWS])
@pytest.mark.parametrize("isa", qmatmul.ISAS[1:])
def test_qmatmul_matches_the_dequantized_weight(bits, group, offsets, awq, rows, isa):
  """Every kernel this CPU runs, against float64 numpy twice: (1) with x rounded to int8
  blocks in numpy as qmatmul.cc documents, to f32 summation error; (2) with the exact x
  and the dequantized weight, to f32 error plus x's rounding: at most half a block's
  scale an input, times |dequantized weight| (the bound the integer dot adds to the
  f32 products of exact codes the kernel computed before).  A kernel this CPU lacks
  fails the call, naming its isa."""
  assert qmatmul.available()
  q, x = _case(bits, group, offsets, awq, rows)
  run = jax.jit(functools.partial(qmatmul.qmatmul, isa=isa))
  if isa not in qmatmul.supported_isas():
    with pytest.raises(Exception, match=f"isa {qmatmul.ISAS.index(isa)} is not one"):
      jax.block_until_ready(run(jnp.asarray(x), q))
    return
  got = np.asarray(run(jnp.asarray(x), q), np.float64)
  w = numpy_dequantize(q)
  xk = _kernel_input(x, q)
  codes, scales = numpy_quantize_activations(xk, numpy_activation_blocks(x.shape[1],
                                                                          q.group_size))
  scaled = numpy_codes(q) * numpy_group_rows(q, "scales")
  emulated = (codes.astype(np.float64) * scales) @ scaled
  if q.offsets is not None:  # offsets meet the f32 sums of x, not of its codes
    emulated += xk.astype(np.float64) @ numpy_group_rows(q, "offsets")
  assert np.all(np.abs(got - emulated) <= f32_tolerance(x, w)), np.abs(got - emulated).max()
  rounding = (scales.astype(np.float64) / 2) @ np.abs(scaled)
  want = x.astype(np.float64) @ w
  error = np.abs(got - want)
  assert np.all(error <= rounding * (1 + 1e-5) + f32_tolerance(x, w)), error.max()
  assert error.max() > 0.05 * rounding.max()  # the bound is tight enough to mean something


@pytest.mark.parametrize("bits,group,offsets,awq", CASES)
def test_every_kernel_gives_the_same_bits(bits, group, offsets, awq):
  """The generic loops and the vector kernels do the same integer sums and the same f32
  fused multiply-adds in the same order: equal outputs (so the generic one, checked
  against numpy above, vouches for the others on every CPU that runs them)."""
  q, x = _case(bits, group, offsets, awq, 5)
  outputs = {isa: np.asarray(jax.jit(functools.partial(qmatmul.qmatmul, isa=isa))(
      jnp.asarray(x), q)) for isa in qmatmul.supported_isas()}
  assert "generic" in outputs and len(outputs) >= 2, outputs.keys()  # this CI has AVX2
  for isa, y in outputs.items():
    np.testing.assert_array_equal(y, outputs["generic"], err_msg=isa)


GGUF_KEPT = [(t, scheme) for t in gguf_quants.SUPPORTED_TYPES for scheme in ("int8", "int4-g32")
             if gguf_quants.maps_blocks(t, scheme)]


@pytest.mark.parametrize("type_name,scheme", GGUF_KEPT)
def test_qmatmul_on_every_gguf_block_type_kvjax_keeps(type_name, scheme):
  """Each GGUF block type the loader keeps quantized (Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K,
  as int8 or int4-g32), through every kernel this CPU runs, against gguf's own
  dequantization (llama.cpp's reference) in float64: within x's int8 rounding."""
  assert GGUF_KEPT and qmatmul.available()
  i, o = 512, 200  # 2 super-blocks of 256 inputs; 3 blocks of 64 outputs and a ragged one
  raw = gguf_bytes(type_name, o, i, seed=5)
  q = gguf_quants.blocks_qweight(raw, type_name, scheme, (i, o), 1)
  w = gguf_reference(raw, type_name).T.astype(np.float64)  # [I, O]
  x = np.random.default_rng(1).standard_normal((3, i)).astype(np.float32)
  _, scales = numpy_quantize_activations(x, numpy_activation_blocks(i, q.group_size))
  rounding = (scales.astype(np.float64) / 2) @ np.abs(numpy_codes(q) *
                                                     numpy_group_rows(q, "scales"))
  for isa in qmatmul.supported_isas():
    got = jax.jit(functools.partial(qmatmul.qmatmul, isa=isa))(jnp.asarray(x), q)
    error = np.abs(np.asarray(got, np.float64) - x.astype(np.float64) @ w)
    assert np.all(error <= rounding * (1 + 1e-5) + f32_tolerance(x, w)), (isa, error.max())


def test_non_finite_activations_give_nan_rows_and_a_bad_isa_is_named():
  q, x = _case(4, 32, True, False, 2)
  x[0, 7] = np.inf
  got = np.asarray(jax.jit(qmatmul.qmatmul)(jnp.asarray(x), q))
  assert np.all(np.isnan(got[0])) and np.all(np.isfinite(got[1]))
  with pytest.raises(ValueError, match="isa='sse9'"):
    qmatmul.qmatmul(jnp.asarray(x), q, isa="sse9")


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
  weight dequantized in numpy and run in float, to the activations' int8 rounding."""
  cfg = tied_model.config
  params = quantize_params(tied_model.params, cfg, scheme)
  assert tied_model.params.lm_head is None and isinstance(params.lm_head, QuantizedWeight)
  assert params.lm_head.bits == 8 and params.lm_head.scales.shape == (1, cfg.vocab_size)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 16))
  model = kvjax.Model(cfg, params)
  assert qmatmul.TARGET in _hlo(lambda p: kvjax.model.decoder.forward(p, cfg, jnp.asarray(tokens)),
                                params)
  got = np.asarray(kvjax.forward(model, tokens))
  want = np.asarray(kvjax.forward(kvjax.Model(cfg, _float_params(params)), tokens))
  # Not to f32 rounding (1e-4 of the largest logit before the integer-dot kernel): every
  # matmul rounds its input to int8 per 32 values (each off by up to 1/254 of its
  # block's max, ~0.5% rms), compounding over the layers: 1.0% measured at int8, below
  # the 1.3% int8 weights cost; 3% still fails a kernel that misplaces a column.
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.03
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
