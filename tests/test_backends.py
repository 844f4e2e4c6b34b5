"""Backends are capability records chosen by name: the Pallas kernels (interpret mode)
and pallas_kernels' own references drive the model to the same tokens as kvjax's jnp
gather, a researcher's record is actually called, and nothing global is mutated."""
from __future__ import annotations

import dataclasses

import pytest

import kvjax
from kvjax.attention import backends
from kvjax.attention.paged import paged_attention

PROMPTS = [[5, 9, 11], [7] * 13, [42, 17, 256, 3, 99, 1]]


@pytest.mark.parametrize("backend,window", [("pallas_interpret", 6), ("pallas_reference", None)])
def test_pallas_backends_generate_like_reference(tiny_model, backend, window):
  model = kvjax.Model(tiny_model.config.replace(sliding_window=window), tiny_model.params)
  expected = kvjax.generate(model, PROMPTS, 5, page_size=8).tokens
  assert kvjax.generate(model, PROMPTS, 5, page_size=8, backend=backend).tokens == expected


def test_a_researchers_record_is_used_without_registering(tiny_model):
  calls = []

  def traced_reference(q, k_pages, v_pages, batch, **kwargs):
    calls.append(q.shape)  # recorded once per layer at trace time
    return paged_attention(q, k_pages, v_pages, batch.kv_lens, batch.block_tables, **kwargs)

  mine = dataclasses.replace(backends.get_backend("reference"), name="traced",
                             attention=traced_reference)
  before = dict(backends.BACKENDS)
  out = kvjax.generate(tiny_model, PROMPTS[:1], 4, backend=mine).tokens
  assert out == kvjax.generate(tiny_model, PROMPTS[:1], 4).tokens
  assert len(calls) >= tiny_model.config.num_layers
  assert dict(backends.BACKENDS) == before and "traced" not in backends.backend_names()
  with pytest.raises(TypeError):
    backends.BACKENDS["traced"] = mine  # the built-in table is read-only


# name: (kv_dtype, MLA?) -> the built-in backends that serve it
CAPABILITIES = {
    "int8": ("int8", False, {"reference", "pallas", "pallas_interpret", "pallas_reference"}),
    "int4": ("int4", False, {"reference"}),
    "bf16": ("bf16", False, {"reference", "pallas", "pallas_interpret", "pallas_reference"}),
    "mla": (None, True, {"reference"}),
}


@pytest.mark.parametrize("name", sorted(CAPABILITIES))
def test_capabilities_decide_support(name):
  kv_dtype, mla, supported = CAPABILITIES[name]
  for backend_name in backends.backend_names():
    backend = backends.get_backend(backend_name)
    check = backend.check_mla if mla else lambda: backend.check_kv_dtype(kv_dtype)
    if backend_name in supported:
      check()
    else:
      with pytest.raises(ValueError, match=repr(backend_name)):
        check()


def test_unknown_backend_is_named():
  with pytest.raises(ValueError, match="'pallas-typo'"):
    backends.get_backend("pallas-typo")
