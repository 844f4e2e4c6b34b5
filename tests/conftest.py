"""Shared fixtures: models are built once per session so jit caches are reused."""
from __future__ import annotations

import pytest

import kvjax


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
