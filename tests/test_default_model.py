"""The shipped default model: loads, and its card's numbers hold on a fixed held-out slice.

Bits per byte is recomputed here with `kvjax.model.forward` and a float64 numpy
log-softmax (independent of kvjax.train's loss); MTP greedy acceptance is
re-measured on the card's held-out prompts.  Both slices are pinned by the
sha256 the card records, so a different stdlib skips the exact comparisons.
"""
import json
import math
import os

import numpy as np
import pytest

from kvjax import corpus as corpus_lib
from kvjax import model as model_lib
from kvjax import train as train_lib
from kvjax.config import get_preset
from kvjax.weights import checkpoint

GOAL_BITS_PER_BYTE = 1.8


@pytest.fixture(scope="module")
def default_model():
  cfg, params = checkpoint.restore()
  with open(os.path.join(checkpoint.DEFAULT_MODEL_DIR, "model_card.json")) as f:
    card = json.load(f)
  corpus = corpus_lib.load_corpus(heldout_fraction=card["corpus"]["heldout_fraction"])
  return cfg, params, card, corpus_lib.split_tokens(corpus, "heldout")


def _dir_bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_loads_as_the_tiny_code_preset_and_stays_small(default_model):
  cfg, params, card, _ = default_model
  assert cfg == get_preset("tiny-code")
  assert len(params.mtp) == cfg.mtp_num_hidden_layers == 2
  assert card == checkpoint.read_metadata(checkpoint.DEFAULT_MODEL_DIR)
  assert _dir_bytes(checkpoint.DEFAULT_MODEL_DIR) < 40 * 2**20


def test_heldout_bits_per_byte_matches_card_and_goal(default_model):
  cfg, params, card, heldout = default_model
  fixed = card["eval"]["slice"]
  windows = corpus_lib.heldout_slice(heldout, fixed["seq_len"], fixed["windows"])
  if corpus_lib.tokens_sha256(windows) != fixed["sha256"]:
    pytest.skip("this interpreter's stdlib differs from the one the card measured")
  logits = np.asarray(model_lib.forward(params, cfg, windows[:, :-1]), np.float64)
  targets = windows[:, 1:]
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nats = log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  is_byte = targets < 256
  bits_per_byte = nats[is_byte].sum() / is_byte.sum() / math.log(2)
  assert bits_per_byte == pytest.approx(fixed["bits_per_byte"], abs=1e-3)
  assert bits_per_byte <= GOAL_BITS_PER_BYTE
  assert card["eval"]["heldout_bits_per_byte"] <= GOAL_BITS_PER_BYTE


def test_mtp_greedy_acceptance_matches_card(default_model):
  cfg, params, card, heldout = default_model
  fixed, headline = card["eval"]["slice"], card["eval"]["mtp_acceptance"]
  prompts = corpus_lib.heldout_slice(heldout, headline["prompt_len"] - 1, fixed["prompts"])
  if corpus_lib.tokens_sha256(prompts) != fixed["prompts_sha256"]:
    pytest.skip("this interpreter's stdlib differs from the one the card measured")
  measured = train_lib.mtp_acceptance(params, cfg, prompts, headline["new_tokens"])
  expected = fixed["mtp_acceptance"]
  np.testing.assert_allclose(measured["per_position"], expected["per_position"], atol=0.02)
  assert measured["mean_accepted_length"] == pytest.approx(
      expected["mean_accepted_length"], abs=0.04)
  # The slice is a sample of the card's headline measurement, not a different regime.
  assert measured["mean_accepted_length"] == pytest.approx(
      headline["mean_accepted_length"], abs=0.35)
  assert 1.0 <= headline["mean_accepted_length"] <= 1 + cfg.mtp_num_hidden_layers
