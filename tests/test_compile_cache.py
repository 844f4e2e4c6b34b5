"""--compile-cache: a second start of the same configuration compiles nothing.

Oracles: jax's own compile events as serve reports them (XLA compiles vs loads from
the persistent cache, kvjax.runtime.xla_options.xla_compile_counts), the cache directory's
files, and the first start's greedy tokens (compiled fresh) for the second's
(loaded programs)."""
from __future__ import annotations

import re

import pytest

from tests.gateway_servers import ServeProcess

pytestmark = pytest.mark.slow  # 2 starts, each compiling or loading every variant

_WARM = r"XLA compiled (\d+) programs, loaded (\d+) from the compile cache; ready ([\d.]+) s"
_PROMPT = [5, 9, 11, 3, 7]
# The tiny preset (2 layers) on 2 rows, 16-token chunks, 2-page tables: 20 warm-up runs.
_ARGS = ("--checkpoint", "tiny", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
         "--max-model-len", "32", "--page-size", "16")


def _start(cache, *extra) -> tuple[int, int, float, dict]:
  """serve (background warm-up) -> (compiled, loaded, seconds to ready, a greedy answer)."""
  with ServeProcess([*_ARGS, "--compile-cache", str(cache), *extra]) as s:
    compiled, loaded, ready_s = s.wait_for_stderr(_WARM, 400).groups()
    answer = s.complete(_PROMPT, 12)["choices"][0]
    return int(compiled), int(loaded), float(ready_s), answer


@pytest.fixture(scope="module")
def two_starts(tmp_path_factory):
  cache = tmp_path_factory.mktemp("xla-cache")
  return cache, _start(cache), _start(cache)


def test_the_second_start_compiles_nothing(two_starts):
  cache, (compiled1, loaded1, ready1, answer1), (compiled2, loaded2, ready2, answer2) = \
      two_starts
  assert compiled1 > 0 and len(list(cache.iterdir())) >= compiled1
  assert compiled2 == 0 and loaded2 >= compiled1 + loaded1
  assert ready2 < ready1
  assert answer2 == answer1  # loaded programs compute what the compiled ones did


def test_none_turns_the_cache_off(two_starts, tmp_path):
  compiled, loaded, _, _ = _start("none")
  assert compiled > 0 and loaded == 0
