"""Sliding windows (claim C16): a fact beyond the window is lost, one inside is kept.

With window W, position p attends to keys j with p - W < j <= p.  Stacking
layers widens what the last position can see: after layers with windows
W_1..W_L its output depends exactly on tokens j >= p - sum_l (W_l - 1), and a
full-attention layer makes that unbounded.  Masked keys get weight exactly 0,
so a token outside the receptive field leaves the logits bit-identical, while
changing one inside it changes them.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.caches import create_paged_cache
from kvjax.runtime.step_batch import make_step_batch
from kvjax.runtime.steps import prefill

T = 40  # sequence length; the last position p = T - 1 carries the "question"
BASE = [(7 * i + 3) % 500 for i in range(T)]
NEEDLE = 411  # the "fact": a token swapped in at one position


def _model(tiny_model, num_layers, windows):
  cfg = tiny_model.config.replace(num_layers=num_layers, layer_windows=tuple(windows),
                                  name=f"window-{num_layers}-{windows}")
  return kvjax.Model(cfg, tiny_model.params.replace(blocks=tiny_model.params.blocks[:num_layers]))


def _last_logits(model, tokens, cache):
  if cache == "none":
    return np.asarray(kvjax.forward(model, [tokens]))[0, -1]
  cache = create_paged_cache(model.config, None, 1, 1 + 8, 8, jnp.float32)
  batch = make_step_batch([tokens], [0], [len(tokens)], 1 + np.arange(8)[None])
  _, logits, _ = prefill(model.params, cache, batch, config=model.config)
  return np.asarray(logits[0])


def _with_needle(position):
  tokens = list(BASE)
  tokens[position] = NEEDLE
  return tokens


# (layers, per-layer windows, receptive field sum(W - 1) or None if unbounded)
SCENARIOS = {
    "one_layer": (1, (8,), 7),
    "two_layers": (2, (8, 8), 14),
    "mixed_windows": (2, (4, 10), 12),
    "global_layer": (2, (8, None), None),
}


@pytest.mark.parametrize("cache", ["none", "paged"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_needle_beyond_the_receptive_field_is_lost(tiny_model, name, cache):
  num_layers, windows, field = SCENARIOS[name]
  model = _model(tiny_model, num_layers, windows)
  p = T - 1
  base = _last_logits(model, BASE, cache)
  inside = _last_logits(model, _with_needle(p - (field or 20)), cache)
  assert np.abs(inside - base).max() > 1e-4, "a fact inside the field must change the output"
  far = _last_logits(model, _with_needle(p - (field or 20) - 1), cache)
  if field is None:  # a full-attention layer still reaches it
    assert np.abs(far - base).max() > 1e-4
  else:  # exactly lost: masked keys contribute exactly zero
    np.testing.assert_array_equal(far, base)


@pytest.mark.parametrize("windows", [(4, None), (5, 3)])
def test_per_layer_windows_agree_across_caches(tiny_model, windows):
  model = _model(tiny_model, 2, windows)
  prompts = [BASE[:19], BASE[5:12]]
  outs = {cache: kvjax.generate(model, prompts, 12, cache=cache, page_size=4).tokens
          for cache in ("paged", "contiguous", "none")}
  assert outs["paged"] == outs["none"] == outs["contiguous"]
