"""rejection_sample (claim C10): kernel (interpret) == reference, and the rule's statistics.

Kernel and reference draw identical noise from per-row `keys`, so they are compared
exactly on a few hundred rows; the distribution tests (>= 65,536 rows) run on
the jitted reference, which the exact comparison ties to the kernel.
Per-bin bound: |count - n p| <= 6 sqrt(n p (1 - p)) + 5; zero-probability bins
must never be drawn.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import greedy_verify
from pallas_kernels import rejection_sample
from pallas_kernels import rejection_sample_reference
from tests.device_checks import assert_no_host_callback

N_ROWS = 65_536


def row_keys(seed: int, batch: int) -> jax.Array:
  return jax.random.split(jax.random.key(seed), batch)


def assert_follows(samples, probs, what):
  probs = np.asarray(probs, np.float64)
  n = len(samples)
  counts = np.bincount(samples, minlength=len(probs))
  assert len(counts) == len(probs), f"{what}: id out of range"
  bound = 6 * np.sqrt(n * probs * (1 - probs)) + 5
  bad = np.abs(counts - n * probs) > bound
  assert not bad.any(), f"{what}: counts {counts} vs expected {n * probs}"
  assert np.all(counts[probs == 0] == 0), f"{what}: drew a zero-probability bin"


def softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def spec_problem():
  """K=2 drafts over V=8 with zero-probability bins in target and drafter."""
  target_logits = np.array([
      [2.0, 1.0, 0.5, -np.inf, 0.0, 1.5, -1.0, 0.2],
      [0.0, 2.5, -np.inf, 1.0, 0.3, -0.5, 1.0, 0.0],
      [1.0, 0.0, 0.0, 2.0, -np.inf, 0.5, -2.0, 1.0],
  ], np.float32)  # [K+1, V]
  draft_probs = np.array([
      [0.3, 0.1, 0.0, 0.2, 0.1, 0.2, 0.0, 0.1],
      [0.1, 0.3, 0.2, 0.0, 0.1, 0.1, 0.2, 0.0],
  ], np.float32)  # [K, V]
  rng = np.random.default_rng(0)
  drafts = np.stack([rng.choice(8, N_ROWS, p=draft_probs[k] / draft_probs[k].sum())
                     for k in range(2)], axis=1).astype(np.int32)  # [B, K]
  args = (jnp.asarray(drafts), jnp.broadcast_to(draft_probs, (N_ROWS, 2, 8)),
          jnp.broadcast_to(target_logits, (N_ROWS, 3, 8)),
          jnp.full((N_ROWS,), 2, jnp.int32), row_keys(42, N_ROWS))
  tokens, n_acc = rejection_sample_reference(*args, temperature=jnp.ones(N_ROWS))
  return softmax(target_logits), draft_probs, np.asarray(tokens), np.asarray(n_acc)


def test_first_token_follows_target_row0(spec_problem):
  p_target, _, tokens, _ = spec_problem
  assert_follows(tokens[:, 0], p_target[0], "first emitted token")


def test_token_at_rejection_follows_residual(spec_problem):
  p_target, p_draft, tokens, n_acc = spec_problem
  residual = np.maximum(p_target[0] - p_draft[0], 0)
  assert_follows(tokens[n_acc == 0, 0], residual / residual.sum(), "residual at stop")
  residual1 = np.maximum(p_target[1] - p_draft[1], 0)
  assert_follows(tokens[n_acc == 1, 1], residual1 / residual1.sum(), "residual row 1")


def test_accepted_count_distribution(spec_problem):
  p_target, p_draft, tokens, n_acc = spec_problem
  a0, a1 = (np.minimum(p_draft[k], p_target[k]).sum() for k in range(2))
  assert_follows(n_acc, [1 - a0, a0 * (1 - a1), a0 * a1], "accepted count")
  assert_follows(tokens[n_acc == 2, 2], p_target[2], "bonus token")
  rows = np.arange(len(n_acc))
  assert np.all(tokens[rows[n_acc < 2], n_acc[n_acc < 2] + 1] == -1), "padding"


def random_case(batch, num_k, vocab, seed, with_probs=True):
  rng = np.random.default_rng(seed)
  target = rng.standard_normal((batch, num_k + 1, vocab)).astype(np.float32)
  draft_logits = target[:, :num_k] + rng.standard_normal((batch, num_k, vocab)) * 0.7
  draft_probs = softmax(draft_logits).astype(np.float32)
  draft_probs[:, :, 3] = 0.0  # a zero-probability bin in the drafter
  draft_probs /= draft_probs.sum(-1, keepdims=True)
  drafts = np.array([[rng.choice(vocab, p=draft_probs[b, k] / draft_probs[b, k].sum())
                      for k in range(num_k)] for b in range(batch)], np.int32)
  drafts[::7, 0] = 3  # a zero-draft-probability token: always rejected
  num_draft = rng.integers(0, num_k + 1, batch).astype(np.int32)
  temperature = rng.choice([0.0, 0.7, 1.0], batch).astype(np.float32)
  return (jnp.asarray(drafts), jnp.asarray(draft_probs) if with_probs else None,
          jnp.asarray(target), jnp.asarray(num_draft), row_keys(seed, batch)), temperature


@pytest.mark.parametrize("with_probs,chunk_tiles", [(True, 1), (False, 2)],
                         ids=["probs_3_chunks", "one_hot_2_chunks"])
def test_kernel_equals_reference(with_probs, chunk_tiles):
  args, temperature = random_case(192, 3, 37, seed=1, with_probs=with_probs)
  got = rejection_sample(*args, temperature=temperature, interpret=True, block_v=16,
                         chunk_tiles=chunk_tiles)
  want = rejection_sample_reference(*args, temperature=temperature)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  n_acc = np.asarray(want[1])
  assert 0 < n_acc.mean() < 3, "degenerate case"
  if with_probs:  # zero draft probability is a rejection
    assert np.all(n_acc[::7][np.asarray(args[3])[::7] > 0] == 0)


GREEDY_ARGMAX = [5, 3, 7, 2]  # argmax of target rows 0..3 (K = 3)
GREEDY_SCENARIOS = {
    # name: (drafts, num_draft, expected tokens, expected num_accepted)
    "perfect_match": ([5, 3, 7], 3, [5, 3, 7, 2], 3),
    "early_mismatch": ([5, 4, 7], 3, [5, 3, -1, -1], 1),
    "first_mismatch": ([1, 3, 7], 3, [5, -1, -1, -1], 0),
    "num_draft_0": ([5, 3, 7], 0, [5, -1, -1, -1], 0),
    "ragged_match": ([5, 3, 0], 2, [5, 3, 7, -1], 2),
    "last_mismatch": ([5, 3, 6], 3, [5, 3, 7, -1], 2),
}


def greedy_batch(names):
  vocab = 11
  logits = np.zeros((len(names), 4, vocab), np.float32)
  logits[:, np.arange(4), GREEDY_ARGMAX] = 3.0
  rows = [GREEDY_SCENARIOS[n] for n in names]
  args = (jnp.asarray([r[0] for r in rows], jnp.int32), None, jnp.asarray(logits),
          jnp.asarray([r[1] for r in rows], jnp.int32), row_keys(0, len(rows)))
  want = (np.array([r[2] for r in rows]), np.array([r[3] for r in rows]))
  return args, want


@pytest.mark.parametrize("name", list(GREEDY_SCENARIOS))
def test_greedy_scenario(name):
  args, (tokens, n_acc) = greedy_batch([name])
  got = rejection_sample_reference(*args, temperature=jnp.zeros(1))
  np.testing.assert_array_equal(np.asarray(got[0]), tokens)
  np.testing.assert_array_equal(np.asarray(got[1]), n_acc)


def test_greedy_verify_scenarios():
  """The noise-free fast path meets the same table as the full sampler."""
  names = list(GREEDY_SCENARIOS)
  (drafts, _, logits, num_draft, _), (tokens, n_acc) = greedy_batch(names)
  got = greedy_verify(drafts, logits, num_draft)
  np.testing.assert_array_equal(np.asarray(got[0]), tokens)
  np.testing.assert_array_equal(np.asarray(got[1]), n_acc)


def test_greedy_verify_equals_reference_at_temperature_0():
  """Random logits with NaN entries, ties and out-of-range drafts: same tokens."""
  rng = np.random.default_rng(7)
  batch, num_k, vocab = 256, 3, 9
  logits = rng.integers(-2, 3, (batch, num_k + 1, vocab)).astype(np.float32)  # many ties
  logits[rng.random(logits.shape) < 0.05] = np.nan
  logits[5] = np.nan  # whole rows of NaN emit id 0
  amax = np.nanargmax(np.where(np.isnan(logits), -np.inf, logits), axis=-1)
  drafts = np.where(rng.random((batch, num_k)) < 0.7, amax[:, :num_k],
                    rng.integers(-2, vocab + 2, (batch, num_k))).astype(np.int32)
  num_draft = rng.integers(0, num_k + 1, batch).astype(np.int32)
  args = (jnp.asarray(drafts), jnp.asarray(logits), jnp.asarray(num_draft))
  got = greedy_verify(*args)
  want = rejection_sample_reference(args[0], None, args[1], args[2], row_keys(0, batch),
                                    temperature=jnp.zeros(batch))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert 0 < np.asarray(want[1]).mean() < num_k, "degenerate case"
  assert np.asarray(got[0]).max() < vocab


def test_greedy_mixed_batch_kernel():
  names = list(GREEDY_SCENARIOS) * 2
  args, (tokens, n_acc) = greedy_batch(names)
  got = rejection_sample(*args, temperature=jnp.zeros(len(names)), interpret=True,
                         block_v=16)
  np.testing.assert_array_equal(np.asarray(got[0]), tokens)
  np.testing.assert_array_equal(np.asarray(got[1]), n_acc)


def test_self_draft_accepts_everything():
  rng = np.random.default_rng(3)
  batch, num_k, vocab = 64, 3, 50
  target = rng.standard_normal((batch, num_k + 1, vocab)).astype(np.float32) * 2
  for temp in (1.0, 0.6):
    draft_probs = softmax(target[:, :num_k] / temp).astype(np.float32)
    key = jax.random.key(int(temp * 10))
    drafts = jax.random.categorical(key, jnp.log(draft_probs)).astype(jnp.int32)
    args = (drafts, jnp.asarray(draft_probs), jnp.asarray(target),
            jnp.full((batch,), num_k, jnp.int32), jax.random.split(key, batch))
    got = rejection_sample(*args, temperature=jnp.full((batch,), temp),
                           interpret=True, block_v=16)
    assert np.all(np.asarray(got[1]) == num_k)
    np.testing.assert_array_equal(np.asarray(got[0])[:, :num_k], np.asarray(drafts))


@pytest.mark.parametrize("vocab,block_v", [(8193, 2048), (151936, 16384)])
def test_no_id_beyond_vocab(vocab, block_v):
  batch, num_k = 6, 2
  logits = np.full((batch, num_k + 1, vocab), -5.0, np.float32)
  logits[0] = np.nan  # NaN row
  logits[1] = -np.inf  # no finite score
  logits[2:, :, vocab - 1] = 20.0  # the peak sits in the partial last tile
  draft_probs = np.full((batch, num_k, vocab), 1.0 / vocab, np.float32)
  drafts = np.full((batch, num_k), vocab - 2, np.int32)
  args = (jnp.asarray(drafts), jnp.asarray(draft_probs), jnp.asarray(logits),
          jnp.asarray([2, 2, 2, 0, 1, 2], jnp.int32), row_keys(7, batch))
  temperature = jnp.asarray([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
  tokens, n_acc = rejection_sample(*args, temperature=temperature, interpret=True,
                                   block_v=block_v)
  tokens, n_acc = np.asarray(tokens), np.asarray(n_acc)
  assert tokens.max() < vocab and tokens[tokens != -1].min() >= 0
  assert np.all(tokens[np.arange(batch), n_acc] >= 0)
  assert np.all(tokens[2:, 0] == vocab - 1), tokens
  ref_tokens, ref_n_acc = rejection_sample_reference(*args, temperature=temperature)
  np.testing.assert_array_equal(tokens, np.asarray(ref_tokens))
  np.testing.assert_array_equal(n_acc, np.asarray(ref_n_acc))


def test_rows_depend_on_their_own_key_only():
  """Per-row keys: a row verified alone equals the same row inside a larger batch."""
  args, temperature = random_case(24, 3, 37, seed=4)
  together = rejection_sample(*args, temperature=temperature, interpret=True, block_v=16)
  for b in (0, 5, 23):
    alone = rejection_sample(*(None if a is None else a[b:b + 1] for a in args),
                             temperature=temperature[b:b + 1], interpret=True, block_v=16)
    np.testing.assert_array_equal(np.asarray(alone[0])[0], np.asarray(together[0])[b])
    np.testing.assert_array_equal(np.asarray(alone[1])[0], np.asarray(together[1])[b])


def test_no_host_transfer_and_no_callback():
  """Inputs already on the device: the kernel runs under a transfer guard, twice with one
  trace, and its program holds no host callback (a host sync in disguise)."""
  args, temperature = random_case(8, 3, 37, seed=2)
  args = jax.device_put(args)
  temperature = jax.device_put(temperature)
  kernel = jax.jit(lambda *a: rejection_sample(*a[:-1], temperature=a[-1], interpret=True,
                                               block_v=16))
  with jax.transfer_guard("disallow"):
    for _ in range(2):
      tokens, n_acc = kernel(*args, temperature)
  assert kernel._cache_size() == 1
  assert_no_host_callback(kernel.lower(*args, temperature))
  assert tokens.shape == (8, 4) and n_acc.dtype == jnp.int32


@pytest.mark.parametrize("bad,match", [
    (dict(draft_tokens=jnp.zeros((4, 3), jnp.float32)), "draft_tokens"),
    (dict(target_logits=jnp.zeros((4, 3, 10))), "target_logits.shape"),
    (dict(draft_probs=jnp.zeros((4, 3, 9))), "draft_probs.shape"),
    (dict(num_draft=jnp.zeros((5,), jnp.int32)), "num_draft"),
])
def test_errors_name_the_bad_value(bad, match):
  args = dict(draft_tokens=jnp.zeros((4, 3), jnp.int32), draft_probs=None,
              target_logits=jnp.zeros((4, 4, 10)), num_draft=jnp.zeros((4,), jnp.int32),
              keys=row_keys(0, 4))
  args.update(bad)
  with pytest.raises(ValueError, match=match):
    rejection_sample(**args, temperature=jnp.ones(4), interpret=True)
