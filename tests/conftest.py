"""Shared fixtures: models are built once per session so jit caches are reused."""
from __future__ import annotations

import os

import jax
import pytest

import kvjax

# Every compiled XLA:CPU program keeps LLVM-JIT memory maps; a worker that compiles
# hundreds of them nears the kernel's vm.max_map_count (65,530 by default), and then
# LLVM fails to allocate and XLA segfaults mid-compile.  Above this many maps the
# compiled-program caches are dropped (the next tests recompile what they need).
_MAX_MAPS = 40_000


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
  yield
  if os.path.exists("/proc/self/maps"):
    with open("/proc/self/maps") as f:
      if sum(1 for _ in f) > _MAX_MAPS:
        jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_model():
  return kvjax.load_checkpoint("tiny", seed=0)


@pytest.fixture(scope="session")
def hf_pair(tmp_path_factory):
  """family -> (hf torch model, kvjax Model loaded from its save_pretrained dir)."""
  from tests import hf_models

  cache = {}

  def get(family):
    if family not in cache:
      directory = str(tmp_path_factory.mktemp(family))
      hf_model = hf_models.save_tiny(family, directory)
      cache[family] = (hf_model, kvjax.load_checkpoint(directory))
    return cache[family]

  return get
