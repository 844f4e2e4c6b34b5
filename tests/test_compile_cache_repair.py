"""--compile-cache: a corrupt entry is replaced when its program is recompiled, so only the
first start after the corruption warns and compiles; the next loads every program.

Oracles: jax's own warning for an unreadable entry, its compile and cache-hit events
(kvjax.runtime.xla_options.xla_compile_counts) in a fresh process per start, and the program's
result (x * 2 + 1 of 0, 1, 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvjax.runtime import xla_options

_START = r"""
import json, sys, warnings
import jax, jax.numpy as jnp
from kvjax.runtime.xla_options import use_compile_cache, xla_compile_counts

use_compile_cache(sys.argv[1])
xla_compile_counts()
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  out = jax.jit(lambda x: x * 2 + 1)(jnp.asarray([0.0, 1.0, 2.0]))
compiled, loaded = xla_compile_counts()
print(json.dumps(dict(out=out.tolist(), compiled=compiled, loaded=loaded,
                      warnings=[str(w.message) for w in caught])))
"""
_UNREADABLE = "Error reading persistent compilation cache entry"


def _start(cache) -> dict:
  """One process: the cache on, one small program run -> its result, counts and warnings."""
  run = subprocess.run([sys.executable, "-c", _START, str(cache)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout.strip().splitlines()[-1])


def _entries(cache) -> list:
  return sorted(p for p in cache.iterdir() if p.name.endswith("-cache"))


def test_a_corrupt_entry_is_replaced_when_recompiled(tmp_path):
  first = _start(tmp_path)
  assert first["compiled"] > 0 and first["out"] == [1.0, 3.0, 5.0]
  entries = _entries(tmp_path)
  assert entries
  for entry in entries:
    entry.write_bytes(b"not a compressed executable")
  repaired = _start(tmp_path)  # reads the corrupt entries, warns, compiles, replaces them
  assert any(_UNREADABLE in w for w in repaired["warnings"])
  assert repaired["compiled"] > 0 and repaired["out"] == [1.0, 3.0, 5.0]
  again = _start(tmp_path)
  assert not any(_UNREADABLE in w for w in again["warnings"]), again["warnings"]
  assert again["compiled"] == 0 and again["loaded"] >= first["compiled"]
  assert again["out"] == [1.0, 3.0, 5.0]


def test_put_replaces_an_entry_whole(tmp_path):
  cache = xla_options.ReplacingFileCache(str(tmp_path))
  assert cache.get("k") is None
  cache.put("k", b"corrupt")
  cache.put("k", b"fresh executable")
  assert cache.get("k") == b"fresh executable"
  assert os.listdir(tmp_path) == ["k-cache"]  # no temp file left behind


def test_jax_opens_a_replacing_cache_where_it_can(tmp_path, monkeypatch):
  from jax._src import compilation_cache as jax_cache

  monkeypatch.setattr(jax_cache, "get_file_cache", lambda path: ("jax's own", path))
  assert xla_options._keep_entries_replacing()
  cache, path = jax_cache.get_file_cache(str(tmp_path))
  assert isinstance(cache, xla_options.ReplacingFileCache) and path == str(tmp_path)
  assert jax_cache.get_file_cache("gs://bucket/xla") == ("jax's own", "gs://bucket/xla")
  monkeypatch.delattr(jax_cache, "get_file_cache")  # another jax: its own cache stays
  with pytest.warns(UserWarning, match="recompile at every start"):
    assert not xla_options._keep_entries_replacing()
