"""Hybrid (Gated DeltaNet + full attention) models through the caches and the Engine.

The oracle is the no-cache forward: every linear layer there runs its rule over
the whole sequence from zero states, with no slot, no page and no chunking, so
each engine output must be its teacher-forced argmax.  (That forward equals HF
transformers: tests/test_weights_qwen3_5.py.)
"""
from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.caches import clear_cache_pages, create_contiguous_cache, create_paged_cache
from kvjax.model.params import init_params

MAX_NEW = 8
# Two groups of (2 linear, 1 full): the KV rows and state rows each interleave.
CONFIG = kvjax.ModelConfig(
    name="tiny-hybrid", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=6,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, qk_norm=True,
    layer_types=("linear_attention", "linear_attention", "full_attention") * 2,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_chunk_size=8, attn_output_gate=True,
    partial_rotary_factor=0.5, mtp_num_hidden_layers=2)  # MTP: used only when drafting
ENGINE = dict(page_size=16, max_num_seqs=4, max_model_len=64)


@functools.lru_cache(maxsize=None)
def model() -> kvjax.Model:
  return kvjax.Model(CONFIG, init_params(CONFIG, jax.random.PRNGKey(0), std=0.2))


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 128, int(length)).tolist() for length in rng.integers(17, 33, n)]


def assert_teacher_forced_argmax(prompts, outputs):
  """Each output token is the no-cache forward's argmax after the tokens before it."""
  width = 64  # one padded shape: right padding never changes earlier causal logits
  rows = np.zeros((len(prompts), width), np.int32)
  for i, (p, out) in enumerate(zip(prompts, outputs)):
    rows[i, :len(p) + len(out)] = p + out
  argmax = np.asarray(kvjax.forward(model(), rows)).argmax(-1)
  for i, (p, out) in enumerate(zip(prompts, outputs)):
    assert len(out) == MAX_NEW
    assert argmax[i, len(p) - 1:len(p) + len(out) - 1].tolist() == out, i


def test_cache_holds_kv_for_full_layers_and_state_per_slot():
  paged = create_paged_cache(CONFIG, None, 5, 9, 16, jnp.float32)
  assert paged.k_pages.shape == (2, 2, 9, 16, 16)  # [L = 2 full layers, K, P, Z, H]
  assert paged.conv_state.shape == (4, 5, 3, 2 * 2 * 8 + 4 * 8)  # [Ll, M, Kc - 1, X]
  assert paged.delta_state.shape == (4, 5, 4, 8, 8)  # [Ll, M, Nv, Hk, Hv]
  contiguous = create_contiguous_cache(CONFIG, 5, 32, jnp.float32)
  assert contiguous.k.shape == (2, 5, 32, 2, 16)
  assert contiguous.delta_state.shape == paged.delta_state.shape
  filled = paged.replace(delta_state=paged.delta_state + 1, conv_state=paged.conv_state + 1)
  cleared = clear_cache_pages(filled, jnp.asarray([1]), jnp.asarray([2]))  # a failed slot
  assert float(jnp.abs(cleared.delta_state[:, 2]).max()) == 0.0
  assert float(jnp.abs(cleared.conv_state[:, 2]).max()) == 0.0
  assert float(cleared.delta_state[:, 3].min()) == 1.0  # other slots untouched


@pytest.mark.parametrize("cache", ["paged", "contiguous", "none"])
def test_static_generate_is_the_no_cache_argmax(cache):
  prompts = _prompts(3, seed=1)
  assert_teacher_forced_argmax(prompts, kvjax.generate(model(), prompts, MAX_NEW,
                                                       cache=cache).tokens)


# name: (engine overrides, expect preemption)
SCENARIOS = {
    "chunk_7": (dict(max_num_batched_tokens=7), False),  # chunks never page-aligned
    "chunk_64_no_prefix_cache": (dict(max_num_batched_tokens=64, prefix_cache=False), False),
    # A preempted request recomputes from its own cached blocks: restored state snapshots.
    "preempt_tiny_pool": (dict(max_num_batched_tokens=16, num_pages=5), True),
    # Speculation: every verify row's state rolls back past its rejected drafts.
    "mtp_preempt_tiny_pool": (dict(max_num_batched_tokens=16, num_pages=5,
                                   speculative="mtp"), True),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_engine_mixed_batches_equal_each_request_alone(name):
  """6 requests through 4 rows: slots are reused, prefills chunked and mixed with decodes."""
  overrides, preempts = SCENARIOS[name]
  eng = kvjax.Engine(model(), **{**ENGINE, **overrides})
  prompts = _prompts()
  half = len(prompts) // 2
  finals, logprobs = {}, collections.defaultdict(list)

  def step():
    for out in eng.step():
      logprobs[out.request_id] += [t.logprob for t in out.new_logprobs]
      if out.finished:
        finals[out.request_id] = out.output_ids
    eng.scheduler.check_invariants()
    if eng.snapshots:
      eng.snapshots.check_invariants()

  ids = [eng.add_request(p, MAX_NEW, logprobs=0) for p in prompts[:half]]
  step(), step()
  ids += [eng.add_request(p, MAX_NEW, logprobs=0) for p in prompts[half:]]
  while eng.has_unfinished:
    step()
  assert (eng.scheduler.num_preemptions > 0) == preempts
  if preempts:  # the recomputation resumed from a snapshot of its own prefix
    assert eng.snapshots.num_restored > 0
  assert_no_cache_logprobs(prompts, [finals[i] for i in ids], [logprobs[i] for i in ids])


def _serve(eng, prompt, **options) -> tuple[list[int], list[float], int]:
  """One request alone -> (output ids, their log-probabilities, prefix-hit tokens)."""
  rid = eng.add_request(prompt, MAX_NEW, logprobs=0, **options)
  logprobs = []
  while True:
    for out in eng.step():
      logprobs += [t.logprob for t in out.new_logprobs]
      if out.finished:
        assert out.request_id == rid
        return out.output_ids, logprobs, out.metrics.prefix_hit_tokens


def assert_no_cache_logprobs(prompts, outputs, logprobs):
  """Each output id's log-probability equals the no-cache forward's (1e-4): a state
  restored from the wrong position shifts every logit, even where the argmax holds."""
  assert_teacher_forced_argmax(prompts, outputs)
  rows = np.zeros((len(prompts), 64), np.int32)
  for i, (p, out) in enumerate(zip(prompts, outputs)):
    rows[i, :len(p) + len(out)] = p + out
  full = np.asarray(jax.nn.log_softmax(kvjax.forward(model(), rows), axis=-1))
  for i, (p, out) in enumerate(zip(prompts, outputs)):
    want = full[i, np.arange(len(p) - 1, len(p) + len(out) - 1), out]
    np.testing.assert_allclose(logprobs[i], want, atol=1e-4, err_msg=f"request {i}")


def _sharing(prefix_len: int, tails=(10, 7), seed: int = 3) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  shared = rng.integers(0, 128, prefix_len).tolist()
  return [shared + rng.integers(0, 128, n).tolist() for n in tails]


@pytest.mark.parametrize("prefix_match", ["block", "token"])
def test_prefix_hits_resume_from_the_state_at_the_last_shared_page_boundary(prefix_match):
  """A 40-token shared prefix at 16-token pages: the second request reuses 32 tokens
  of KV and the recurrent state snapshotted at position 32 (token mode too: there is
  no state mid-page) and still gives the no-cache argmax; another salt hits nothing."""
  first, second = _sharing(40)
  eng = kvjax.Engine(model(), **{**ENGINE, "prefix_match": prefix_match})
  ids, logprobs, hits = zip(_serve(eng, first), _serve(eng, second),
                            _serve(eng, second, cache_salt="tenant-b"))
  assert hits == (0, 32, 0)
  assert eng.snapshots.num_restored == 1
  eng.snapshots.check_invariants()
  assert_no_cache_logprobs([first, second, second], ids, logprobs)


def test_multi_turn_hit_resumes_inside_generated_tokens_and_snapshots_stay_bounded():
  """Turn 2 = turn 1's prompt + its answer + more: it hits the boundary at 48, which
  turn 1 reached while decoding (a multi-step burst wrote that snapshot).  With 2
  snapshots the pool evicts the oldest boundaries and stays exact."""
  eng = kvjax.Engine(model(), **{**ENGINE, "prefix_snapshots": 2})
  turn1 = _sharing(44, tails=(0,))[0]
  answer, logprobs1, _ = _serve(eng, turn1)  # positions 44..51 -> boundary 48
  turn2 = turn1 + answer + [5, 6, 7]
  out, logprobs2, hit = _serve(eng, turn2)
  assert hit == 48
  assert eng.snapshots.num_kept <= 2
  eng.snapshots.check_invariants()
  assert_no_cache_logprobs([turn1, turn2], [answer, out], [logprobs1, logprobs2])


def test_injected_drafts_roll_the_state_back_to_the_last_accepted_column():
  """Verify steps accepting 2, 1 and 0 of 2 drafts (drafts set to the true next tokens
  or off by one): each leaves the recurrent state right after its last accepted
  column, so every later token and log-probability is the no-cache forward's."""
  prompt = _prompts(1, seed=9)[0]
  eng = kvjax.Engine(model(), **ENGINE, speculative="mtp", num_draft=2, num_scheduler_steps=1)
  truth = kvjax.Engine(model(), **ENGINE).generate([prompt], MAX_NEW).tokens[0]
  rid = eng.add_request(prompt, MAX_NEW, logprobs=0)
  outputs = []
  while not outputs:
    outputs = eng.step()
  emitted, logprobs = list(outputs[0].new_token_ids), [t.logprob for t in outputs[0].new_logprobs]
  slot = eng.scheduler.requests[rid].slot
  for ok1, ok2, count in ((True, True, 3), (True, False, 2), (False, True, 1)):
    n = len(emitted)
    drafts = [truth[n] if ok1 else (truth[n] + 1) % 128,
              truth[n + 1] if ok2 else (truth[n + 1] + 1) % 128]
    eng.state = eng.state.replace(drafts=eng.state.drafts.at[slot].set(jnp.array(drafts)))
    out, = eng.step()
    assert len(out.new_token_ids) == count, (ok1, ok2)
    emitted += out.new_token_ids
    logprobs += [t.logprob for t in out.new_logprobs]
  while eng.has_unfinished:
    for out in eng.step():
      emitted += out.new_token_ids
      logprobs += [t.logprob for t in out.new_logprobs]
  assert emitted == truth
  assert_no_cache_logprobs([prompt], [emitted], [logprobs])


def test_sampled_speculation_keeps_the_target_distribution():
  """x0 (prefill), x1 and x2 at temperature 1 over 400 seeds, against exact marginals
  from full forwards (P(x2) sums p(a) p(b | a) p(c | a, b)), within 6 sigma; x2 follows
  a verify step that rejected or accepted drafts, so its state was rolled back."""
  prompt, n, vocab = [17, 4, 100, 61, 9], 400, CONFIG.vocab_size
  eng = kvjax.Engine(model(), **ENGINE, speculative="mtp", num_draft=2)
  ids = [eng.add_request(prompt, 3, temperature=1.0, seed=s) for s in range(n)]
  finals = {}
  while eng.has_unfinished:
    finals.update({out.request_id: out for out in eng.step() if out.finished})
  first = np.array([finals[rid].output_ids for rid in ids])  # [n, 3]
  softmax = lambda rows: np.asarray(jax.nn.softmax(kvjax.forward(model(), rows)[:, -1]),
                                    np.float64)
  p0 = softmax(np.array([prompt]))[0]
  grid = np.arange(vocab)
  p1_given = softmax(np.concatenate([np.tile(prompt, (vocab, 1)), grid[:, None]], 1))  # [a, b]
  pairs = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)  # (a, b)
  p2_given = softmax(np.concatenate([np.tile(prompt, (len(pairs), 1)), pairs], 1))  # [ab, c]
  p1 = p0 @ p1_given
  p2 = (p0[:, None] * p1_given).reshape(-1) @ p2_given
  for k, probs in enumerate((p0, p1, p2)):
    counts = np.bincount(first[:, k], minlength=vocab)
    assert np.all(np.abs(counts - n * probs) <= 6 * np.sqrt(n * probs * (1 - probs)) + 5), k
  proposed = sum(sum(out.metrics.proposed) for out in finals.values())
  accepted = sum(sum(out.metrics.accepted) for out in finals.values())
  assert 0 < accepted < proposed  # both ways


@pytest.mark.parametrize("options, match", [
    (dict(kv_dtype="int4"), r"kv_dtype 'int4' is not supported for hybrid model 'tiny-hybrid'"),
    (dict(prefix_snapshots=-1), r"prefix_snapshots must be an int >= 0 or None, got -1"),
])
def test_engine_refuses_what_a_recurrent_state_cannot_serve(options, match):
  with pytest.raises(ValueError, match=match):
    kvjax.Engine(model(), **options)


def test_engine_defaults_turn_the_prefix_cache_on_with_snapshots_for_a_hybrid():
  config = kvjax.EngineConfig(max_num_seqs=4).resolve(model())
  assert config.prefix_cache is True and config.prefix_snapshots == 32
  assert kvjax.EngineConfig(prefix_cache=False).resolve(model()).prefix_snapshots == 0
  dense = kvjax.load_checkpoint("tiny")
  with pytest.raises(ValueError, match=r"prefix_snapshots=4 needs a hybrid model"):
    kvjax.EngineConfig(prefix_snapshots=4).resolve(dense)


def test_qwen35_9b_pool_reproduces_c4_and_the_ledger():
  """The engine's cache for the published shape (abstract arrays): 32 KiB of pages per
  token (C4's measured 32.3 KB within 2%), the ledger's constant state per request,
  and the ledger's parameter count equal to the random-init pytree's."""
  from kvjax.cli.memory import allocated_pool
  from kvjax.model.params import count_params
  from kvjax.parallel import ledger

  cfg = kvjax.get_preset("qwen3.5-9b")
  pool = allocated_pool(cfg, "bf16", "bf16")
  assert pool["kv_bytes_per_token"] == 2 * 8 * 4 * 256 * 2 == 32768
  assert abs(pool["kv_bytes_per_token"] / 1024 / 32.3 - 1) < 0.02
  # 24 DeltaNet layers: conv 3 x 8192 bf16 + delta 32 x 128 x 128 fp32 each.
  assert pool["state_bytes_per_slot"] == 24 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
  assert pool["state_bytes_per_slot"] == ledger.state_bytes_per_request(cfg, "bf16")
  assert pool["snapshot_bytes"] == pool["state_bytes_per_slot"]  # one per cached boundary
  assert allocated_pool(cfg, "bf16", "bf16", include_mtp=True)["kv_bytes_per_token"] == 9 * 4096
  tree = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.PRNGKey(0))
  assert ledger.param_count(cfg) == count_params(tree)


def test_a_backend_record_supplies_the_delta_rule():
  """Backend.delta_rule is where a kernel for the linear layers plugs in: the paged
  path calls the record's rule (here the reference, wrapped to record its shapes)."""
  import dataclasses

  from kvjax.attention.backends import get_backend
  from kvjax.attention.gated_delta import delta_rule

  seen = []

  def spy(q, *args):
    seen.append(q.shape[1])
    return delta_rule(q, *args)

  backend = dataclasses.replace(get_backend("reference"), name="reference+spy", delta_rule=spy)
  prompts = _prompts(3, seed=1)
  assert_teacher_forced_argmax(prompts, kvjax.generate(model(), prompts, MAX_NEW, cache="paged",
                                                       backend=backend).tokens)
  assert 1 in seen and max(seen) > 1  # traced for the decode step and the prefill
