"""experiments/perplexity_peers.py: its log p and summary against hand-computed values."""
from __future__ import annotations

import math

import numpy as np
import pytest

from experiments import perplexity_peers as peers


def test_target_logp_is_the_log_softmax_at_each_target():
  logits = np.array([[0.0, math.log(3.0)], [1000.0, 1000.0 + math.log(0.25)]], np.float32)
  # row 0: softmax (1/4, 3/4); row 1 (large logits: no overflow): (4/5, 1/5)
  got = peers.target_logp(logits, np.array([1, 0]))
  assert got == pytest.approx([math.log(0.75), math.log(0.8)], abs=1e-5)


def test_summary_averages_nats_over_every_token():
  logp = np.log(np.array([[0.5, 0.25], [0.5, 0.125]]))
  nats = (math.log(2) + math.log(4) + math.log(2) + math.log(8)) / 4
  assert peers.summary(logp) == pytest.approx(
      {"nats_per_token": nats, "perplexity": math.exp(nats), "tokens": 4})
