"""Verification is a backend: the engine's speculative step calls the backend's verifier
for the whole batch (the fused Pallas rejection sampler under pallas_interpret), with
fixed shapes, one trace and no host transfer or callback inside the step."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.backends import get_backend
from kvjax.runtime import serve_steps
from tests import engine_helpers as h
from tests.device_checks import assert_no_host_callback

_VERIFY_KERNELS = {"rejection_sample_stats", "rejection_sample_emit"}


def _pallas_names(jaxpr) -> set:
  """Names of every pallas_call in a jaxpr, sub-jaxprs (cond branches, loops) included."""
  found = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found |= {str(v).split(" ")[0] for k, v in eqn.params.items() if "name" in k}
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found |= _pallas_names(sub)
  return found


@pytest.mark.parametrize("backend,kernels", [("pallas_interpret", _VERIFY_KERNELS),
                                             ("reference", set())])
def test_the_engine_step_traces_the_backends_verifier(backend, kernels):
  eng = h.engine(speculative="mtp", backend=backend)
  step = functools.partial(serve_steps._serve_rows, **h.step_static(eng))
  jaxpr = jax.make_jaxpr(step)(eng.model.params, None, eng.state, h.decode_batch(eng, 1.0))
  assert _pallas_names(jaxpr.jaxpr) & _VERIFY_KERNELS == kernels


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_k=50, seed=5)],
                         ids=["greedy", "sampled"])
def test_pallas_verifier_engine_equals_reference(sampling):
  batch = h.prompts(3, seed=61)
  outputs = {}
  for backend in ("reference", "pallas_interpret"):
    eng = h.engine(speculative="mtp", backend=backend, num_scheduler_steps=1)
    outputs[backend] = h.run_staggered(eng, batch, **sampling)
  assert outputs["pallas_interpret"] == outputs["reference"]
  if not sampling:
    assert outputs["reference"] == {i: h.reference(p) for i, p in enumerate(batch)}


def test_the_verify_step_stays_on_the_device():
  eng = h.engine(speculative="mtp")
  static = h.step_static(eng)
  params, state = jax.device_put((eng.model.params, eng.state))
  batch = jax.device_put(h.decode_batch(eng, 0.8))
  before = serve_steps.serve_step._cache_size()
  with jax.transfer_guard("disallow"):  # an implicit host<->device copy raises
    for _ in range(2):
      state, emitted = serve_steps.serve_step(params, None, state, batch, **static)
  assert serve_steps.serve_step._cache_size() - before <= 1  # one trace for both calls
  assert_no_host_callback(serve_steps.serve_step.lower(params, None, state, batch, **static))
  counts = np.asarray(emitted.counts)
  assert emitted.tokens.shape == (2, 1 + eng.num_draft) and np.all((counts >= 1) & (counts <= 3))
