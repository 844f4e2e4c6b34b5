"""Shared fixtures: models are built once per session so jit caches are reused."""
from __future__ import annotations

import os
import shutil
import tempfile

import jax
import pytest

import kvjax

# Every compiled XLA:CPU program keeps LLVM-JIT memory maps; a worker that compiles
# hundreds of them nears the kernel's vm.max_map_count (65,530 by default), and then
# LLVM fails to allocate and XLA segfaults mid-compile.  Above this many maps the
# compiled-program caches are dropped (the next tests recompile what they need).
_MAX_MAPS = 40_000


_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def pytest_configure(config):
  """One persistent compilation cache for the run: the xdist workers and the subprocesses
  tests start (all inherit the environment) compile many of the same step programs, and
  each compiles it once per run instead of once per process (and again after the maps
  guard below drops a worker's programs).  A run's own directory, removed at its end."""
  if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  config._kvjax_jit_cache = tempfile.mkdtemp(prefix="kvjax-jit-cache-")
  os.environ.update(_CACHE_ENV, JAX_COMPILATION_CACHE_DIR=config._kvjax_jit_cache)
  # This process read jax's flags when it imported jax, before the environment had them.
  jax.config.update("jax_compilation_cache_dir", config._kvjax_jit_cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if getattr(config, "_kvjax_jit_cache", None):
    shutil.rmtree(config._kvjax_jit_cache, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
  """A test that uses a module-scoped fixture runs on the worker its module's others do
  (`--dist loadgroup`, pytest.ini): otherwise every worker that gets one builds the
  fixture again, or, for a once_per_run result (tests/run_once.py), sits waiting while
  another builds it (the sharded checks' subprocess kept both CI cores' workers waiting
  for 100 s)."""
  for item in items:
    defs = getattr(item, "_fixtureinfo", None)
    if defs and any(d[-1].scope == "module" for d in defs.name2fixturedefs.values()):
      item.add_marker(pytest.mark.xdist_group(item.module.__name__))


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
