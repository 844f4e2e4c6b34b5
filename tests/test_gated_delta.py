"""The gated delta rule and its conv against a naive float64 per-token recurrence (numpy)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.gated_delta import (LinearInputs, causal_conv, delta_rule_chunked,
                                         delta_rule_step, gated_delta_mix, gated_rms_norm)

B, NV, HK, HV = 2, 3, 8, 5


def naive_delta_rule(q, k, v, g, beta, state):
  """float64, one token at a time, straight from the update rule."""
  q, k, v, g, beta, state = (np.array(x, np.float64) for x in (q, k, v, g, beta, state))
  out = np.zeros(v.shape)
  for b in range(q.shape[0]):
    for n in range(q.shape[2]):
      s = state[b, n].copy()
      for t in range(q.shape[1]):
        s = np.exp(g[b, t, n]) * s
        delta = beta[b, t, n] * (v[b, t, n] - k[b, t, n] @ s)
        s = s + np.outer(k[b, t, n], delta)
        out[b, t, n] = q[b, t, n] @ s
      state[b, n] = s
  return out, state


def naive_conv(x, state, weight):
  """float64 silu(sum_j w[j] * x[t - (Kc - 1) + j]) over [state; x]."""
  history = np.concatenate([state, x], axis=1).astype(np.float64)
  kernel, t = weight.shape[0], x.shape[1]
  y = sum(history[:, j:j + t] * weight[j] for j in range(kernel))
  return y / (1 + np.exp(-y)), history[:, -(kernel - 1):]


def _inputs(t, seed=0):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(B, t, NV, HK))) * HK ** -0.5
  k = unit(rng.normal(size=(B, t, NV, HK)))
  v = rng.normal(size=(B, t, NV, HV))
  g = -rng.uniform(0.01, 1.5, size=(B, t, NV))
  beta = rng.uniform(0.05, 0.95, size=(B, t, NV))
  state = rng.normal(size=(B, NV, HK, HV))
  return q, k, v, g, beta, state


def _f32(*xs):
  return [jnp.asarray(x, jnp.float32) for x in xs]


@pytest.mark.parametrize("t, chunk", [(1, 4), (7, 4), (16, 4), (16, 16), (21, 8), (5, 64)])
def test_chunked_equals_naive_recurrence(t, chunk):
  q, k, v, g, beta, state = _inputs(t)
  want_out, want_state = naive_delta_rule(q, k, v, g, beta, state)
  out, new_state = delta_rule_chunked(*_f32(q, k, v, g, beta, state), chunk)
  np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(new_state, want_state, rtol=2e-5, atol=2e-5)


def test_one_step_decode_chains_to_the_naive_recurrence():
  q, k, v, g, beta, state = _inputs(6, seed=1)
  want_out, want_state = naive_delta_rule(q, k, v, g, beta, state)
  s = jnp.asarray(state, jnp.float32)
  for t in range(6):
    out, s = delta_rule_step(*_f32(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]), s)
    np.testing.assert_allclose(out, want_out[:, t], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(s, want_state, rtol=2e-5, atol=2e-5)


def test_prefill_in_two_chunked_calls_then_decode_equals_one_pass():
  q, k, v, g, beta, state = _inputs(13, seed=2)
  want_out, want_state = naive_delta_rule(q, k, v, g, beta, state)
  first, s = delta_rule_chunked(*_f32(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5],
                                      state), 4)
  second, s = delta_rule_chunked(*_f32(q[:, 5:12], k[:, 5:12], v[:, 5:12], g[:, 5:12],
                                       beta[:, 5:12]), s, 4)
  last, s = delta_rule_step(*_f32(q[:, 12], k[:, 12], v[:, 12], g[:, 12], beta[:, 12]), s)
  got = np.concatenate([first, second, np.asarray(last)[:, None]], axis=1)
  np.testing.assert_allclose(got, want_out, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(s, want_state, rtol=2e-5, atol=2e-5)


def test_decay_and_beta_matter():
  """Sanity of the oracle comparison: a wrong decay or beta would not pass the tolerance."""
  q, k, v, g, beta, state = _inputs(8, seed=3)
  want, _ = naive_delta_rule(q, k, v, g, beta, state)
  for wrong in (naive_delta_rule(q, k, v, 0 * g, beta, state)[0],
                naive_delta_rule(q, k, v, g, 1 - beta, state)[0]):
    assert np.abs(wrong - want).max() > 1e-2


@pytest.mark.parametrize("t", [1, 6])
def test_conv_with_rolling_state_equals_naive_and_skips_padding(t):
  rng = np.random.default_rng(4)
  x, state, weight = rng.normal(size=(2, t, 6)), rng.normal(size=(2, 3, 6)), rng.normal(size=(4, 6))
  want_y, want_state = naive_conv(x, state, weight)
  y, new_state = causal_conv(*_f32(x, state, weight), jnp.asarray([t, t]))
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_state, want_state, rtol=1e-6)
  # Row 1 has only its first column real: its state is the last Kc - 1 real inputs.
  _, padded_state = causal_conv(*_f32(x, state, weight), jnp.asarray([t, 1]))
  np.testing.assert_allclose(padded_state[1], naive_conv(x[1:, :1], state[1:], weight)[1][0],
                             rtol=1e-6)


def test_gated_rms_norm_formula():
  rng = np.random.default_rng(5)
  x, gate, w = rng.normal(size=(3, 8)), rng.normal(size=(3, 8)), rng.normal(size=8)
  want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w * gate / (1 + np.exp(-gate))
  np.testing.assert_allclose(gated_rms_norm(*_f32(x, gate, w), 1e-6), want, rtol=1e-5, atol=1e-6)


def test_mix_padding_columns_leave_states_as_the_real_prefix_does():
  """Row 0 feeds 5 real columns of 8: its outputs and states equal feeding just those 5."""
  rng = np.random.default_rng(6)
  nk, hk, nv, hv, kc = 1, 4, 2, 3, 4
  x = rng.normal(size=(1, 8, 2 * nk * hk + nv * hv))
  g, beta = -rng.uniform(0.1, 1, (1, 8, nv)), rng.uniform(0.1, 0.9, (1, 8, nv))
  weight = rng.normal(size=(kc, x.shape[-1]))
  conv0, delta0 = rng.normal(size=(1, kc - 1, x.shape[-1])), rng.normal(size=(1, nv, hk, hv))

  def mix(cols, length):
    inputs = LinearInputs(*_f32(x[:, :cols], g[:, :cols], beta[:, :cols], weight), nk, hk, nv,
                          hv, chunk=4)
    return gated_delta_mix(inputs, *_f32(conv0, delta0), jnp.asarray([length]))

  out8, conv8, delta8 = mix(8, 5)
  out5, conv5, delta5 = mix(5, 5)
  np.testing.assert_allclose(out8[:, :5], out5, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(conv8, conv5, rtol=1e-6)
  np.testing.assert_allclose(delta8, delta5, rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(delta8) - delta0).max() > 1e-2  # the real columns did write



@pytest.mark.parametrize("t, chunk", [(21, 8), (16, 16), (5, 64)])
def test_captured_states_equal_the_naive_state_after_each_column(t, chunk):
  """The states after chosen columns (prefix-cache snapshots at page boundaries) equal
  the float64 recurrence run over exactly those columns; -1 and >= T give zeros."""
  q, k, v, g, beta, state = _inputs(t, seed=7)
  cols = np.array([[0, t // 2, t - 1, -1], [chunk - 1, min(chunk, t - 1), t, 3 % t]], np.int32)
  out, final, captured = delta_rule_chunked(*_f32(q, k, v, g, beta, state), chunk,
                                            jnp.asarray(cols))
  plain_out, plain_final = delta_rule_chunked(*_f32(q, k, v, g, beta, state), chunk)
  np.testing.assert_array_equal(out, plain_out)  # capturing leaves the main path alone
  np.testing.assert_array_equal(final, plain_final)
  for b in range(B):
    for r, c in enumerate(cols[b]):
      if not 0 <= c < t:
        assert not np.asarray(captured[b, r]).any()
        continue
      _, want = naive_delta_rule(q[b:b + 1, :c + 1], k[b:b + 1, :c + 1], v[b:b + 1, :c + 1],
                                 g[b:b + 1, :c + 1], beta[b:b + 1, :c + 1], state[b:b + 1])
      np.testing.assert_allclose(captured[b, r], want[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("t", [1, 9])
def test_mix_captures_equal_feeding_only_that_many_columns(t):
  rng = np.random.default_rng(8)
  nk, hk, nv, hv, kc = 1, 4, 2, 3, 4
  x = rng.normal(size=(2, t, 2 * nk * hk + nv * hv))
  g, beta = -rng.uniform(0.1, 1, (2, t, nv)), rng.uniform(0.1, 0.9, (2, t, nv))
  weight = rng.normal(size=(kc, x.shape[-1]))
  conv0, delta0 = rng.normal(size=(2, kc - 1, x.shape[-1])), rng.normal(size=(2, nv, hk, hv))
  inputs = lambda cols: LinearInputs(*_f32(x[:, :cols], g[:, :cols], beta[:, :cols], weight),
                                     nk, hk, nv, hv, chunk=4)
  cols = np.array([[t - 1, -1], [t // 3, t - 1]], np.int32)
  *_, (conv_at, delta_at) = gated_delta_mix(inputs(t), *_f32(conv0, delta0),
                                            jnp.asarray([t, t]), jnp.asarray(cols))
  for b in range(2):
    for r, c in enumerate(cols[b]):
      if c < 0:
        assert not np.asarray(conv_at[b, r]).any() and not np.asarray(delta_at[b, r]).any()
        continue
      _, conv_want, delta_want = gated_delta_mix(inputs(c + 1), *_f32(conv0, delta0),
                                                 jnp.asarray([c + 1, c + 1]))
      np.testing.assert_allclose(conv_at[b, r], conv_want[b], rtol=1e-6)
      np.testing.assert_allclose(delta_at[b, r], delta_want[b], rtol=1e-5, atol=1e-6)
