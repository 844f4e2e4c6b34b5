"""Engine and static-batch tokens are bit-identical to those recorded before the
issue-11 refactor (tests/golden_runs.py; seeded-sampled engine runs of plain,
multi-step, MTP, token-mode prefix hits, int8 pages, preemption and a draft model,
and greedy and sampled kvjax.generate over paged, contiguous and no cache)."""
from __future__ import annotations

import json

import pytest

from tests import golden_runs
from tests.run_once import once_per_run


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
  return once_per_run(tmp_path_factory, "golden_replay", golden_runs.record)


@pytest.fixture(scope="module")
def recorded():
  with open(golden_runs.PATH) as f:
    return json.load(f)


def test_every_recorded_run_is_replayed(replayed, recorded):
  assert sorted(replayed) == sorted(recorded)


@pytest.mark.parametrize("name", sorted(json.load(open(golden_runs.PATH))))
def test_tokens_bit_identical(replayed, recorded, name):
  assert [list(t) for t in replayed[name]] == recorded[name]
