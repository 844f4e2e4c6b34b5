"""Attention backends are interchangeable: the Pallas kernel (interpret mode) and
pallas_kernels' own reference drive the model to the same tokens as kvjax's jnp
gather, and a researcher's registered backend is actually called."""
from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.attention import registry
from kvjax.attention.paged import paged_attention

PROMPTS = [[5, 9, 11], [7] * 13, [42, 17, 256, 3, 99, 1]]


@pytest.mark.parametrize("backend,window", [("pallas_interpret", 6), ("pallas_reference", None)])
def test_pallas_backends_generate_like_reference(tiny_model, backend, window):
  model = kvjax.Model(tiny_model.config.replace(sliding_window=window), tiny_model.params)
  expected = kvjax.generate(model, PROMPTS, 5, page_size=8).tokens
  assert kvjax.generate(model, PROMPTS, 5, page_size=8, backend=backend).tokens == expected


def test_registered_backend_is_used(tiny_model):
  calls = []

  def traced_reference(*args, **kwargs):
    calls.append(args[0].shape)  # recorded once per layer at trace time
    return paged_attention(*args, **kwargs)

  registry.register_backend("test-traced-reference", traced_reference)
  out = kvjax.generate(tiny_model, PROMPTS[:1], 4, backend="test-traced-reference").tokens
  assert out == kvjax.generate(tiny_model, PROMPTS[:1], 4).tokens
  assert len(calls) >= tiny_model.config.num_layers
  with pytest.raises(ValueError, match="already registered"):
    registry.register_backend("reference", traced_reference)
