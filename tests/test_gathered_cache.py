"""A decode loop through GatheredKVCache (kvjax/caches/gathered.py) sees what reading the
pages every step sees, leaves the pool as that would, and is what loops really run."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.attention.backends import get_backend
from kvjax.caches import PagedKVCache
from kvjax.caches.gathered import decode_loop_cache
from kvjax.runtime.step_batch import make_step_batch

L, K, N, H, Z, W = 2, 2, 4, 16, 4, 4  # layers, kv heads, q heads, head dim, page size, width
STEPS, T = 3, 2  # loop steps, columns a step feeds (a token and one draft)
STARTS = np.array([5, 0, 9])  # row 1 starts empty; every row stays inside its W * Z tokens


def _pool(int8: bool = False) -> PagedKVCache:
  """A pool of random K/V (stale tokens included), 3 rows' pages scattered in it."""
  cache = PagedKVCache.create(L, K, 1 + 3 * W + 2, Z, H, jnp.int8 if int8 else jnp.float32)
  rng = np.random.default_rng(0)
  return cache.replace(k_pages=jnp.asarray(rng.normal(size=cache.k_pages.shape), cache.k_pages.dtype),
                       v_pages=jnp.asarray(rng.normal(size=cache.v_pages.shape), cache.v_pages.dtype))


def _tables() -> np.ndarray:
  pages = np.random.default_rng(1).permutation(np.arange(1, 1 + 3 * W + 2))[:3 * W]
  return pages.reshape(3, W).astype(np.int32)


def _loop(cache, gather: bool, backend="reference"):
  """STEPS steps of every layer's attend on fixed rows (row 2 feeds 1 column, a padding
  column after it), as a device loop does -> (pool after, outputs [STEPS, L, B, T, N, H])."""
  tables = jnp.asarray(_tables())
  q_lens = np.array([T, T, 1])
  rng = np.random.default_rng(2)
  qkv = [jnp.asarray(rng.normal(size=(STEPS, L, 3, T, n, H)), jnp.float32) for n in (N, K, K)]
  record = get_backend(backend)

  def run(cache):
    loop_cache, settle = decode_loop_cache(cache, tables, record) if gather else (cache, None)
    outs = []
    for step in range(STEPS):
      batch = make_step_batch(np.zeros((3, T), np.int32), STARTS + step * T, q_lens, tables)
      for layer in range(L):
        loop_cache, out = loop_cache.attend(
            layer, qkv[0][step, layer], qkv[1][step, layer], qkv[2][step, layer], batch,
            sm_scale=H ** -0.5, backend=record)
        outs.append(out)
    ends = jnp.asarray(STARTS + (STEPS - 1) * T + q_lens)
    if gather:
      loop_cache = settle(loop_cache, jnp.asarray(STARTS), ends, STEPS * T)
    return loop_cache, jnp.stack(outs)

  return jax.jit(run)(cache)


def test_the_gathered_loop_attends_and_writes_back_what_pages_would():
  pages, want = _loop(_pool(), gather=False)
  settled, got = _loop(_pool(), gather=True)
  assert isinstance(settled, PagedKVCache)
  # The same keys and values in the same core: identical, not merely close.
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Every page but the null one (padding columns write there when pages are read).
  np.testing.assert_array_equal(np.asarray(settled.k_pages)[:, :, 1:],
                                np.asarray(pages.k_pages)[:, :, 1:])
  np.testing.assert_array_equal(np.asarray(settled.v_pages)[:, :, 1:],
                                np.asarray(pages.v_pages)[:, :, 1:])
  # And the loop did write: the pool is not what it was.
  assert not np.array_equal(np.asarray(settled.k_pages), np.asarray(_pool().k_pages))


def test_a_wrong_write_back_would_be_caught():
  """Settling one position short leaves the last step's K/V out of the pool."""
  tables = jnp.asarray(_tables())
  loop_cache, _ = decode_loop_cache(_pool(), tables, "reference")
  full = loop_cache.replace(k=tuple(x + 1.0 for x in loop_cache.k))
  ends = jnp.asarray(STARTS + 2)
  right = full.settle(tables, jnp.asarray(STARTS), ends, 2)
  short = full.settle(tables, jnp.asarray(STARTS), ends - 1, 2)
  assert not np.array_equal(np.asarray(right.k_pages), np.asarray(short.k_pages))
  assert np.array_equal(np.asarray(right.v_pages), np.asarray(short.v_pages))


@pytest.mark.parametrize("case", ["int8", "pallas_interpret"])
def test_pages_the_loop_cannot_copy_are_read_in_place(case):
  cache = _pool(int8=case == "int8")
  backend = "pallas_interpret" if case == "pallas_interpret" else "reference"
  loop_cache, settle = decode_loop_cache(cache, jnp.asarray(_tables()), backend)
  assert loop_cache is cache and settle(loop_cache, None, None, 0) is cache


def test_generate_and_bursts_attend_the_copy_not_the_pages(tiny_model):
  """Traced calls of the backend's two readers: with `gathered_attention` the decode loop
  of kvjax.generate and the engine's burst read pages only outside their loops; without
  it (a record that clears it) they read pages, and give the same tokens."""
  calls = {"attention": 0, "gathered": 0}
  ref = get_backend("reference")

  def counted(name, fn):
    def wrapper(*args, **kwargs):
      calls[name] += 1
      return fn(*args, **kwargs)
    return wrapper

  spy = dataclasses.replace(ref, name="reference+spy",
                            attention=counted("attention", ref.attention),
                            gathered_attention=counted("gathered", ref.gathered_attention))
  paged_only = dataclasses.replace(ref, name="reference-pages", gathered_attention=None)
  layers = tiny_model.config.num_layers
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  got = kvjax.generate(tiny_model, prompts, 6, backend=spy).tokens
  # One prefill trace and one loop-body trace, each through every layer.
  assert calls == {"attention": layers, "gathered": layers}
  assert got == kvjax.generate(tiny_model, prompts, 6, backend=paged_only).tokens

  calls.update(attention=0, gathered=0)
  engine = kvjax.Engine(tiny_model, backend=spy, max_num_seqs=2, num_scheduler_steps=4)
  tokens = engine.generate(prompts, 9).tokens
  assert calls["gathered"] > 0  # the bursts
  paged = kvjax.Engine(tiny_model, backend=paged_only, max_num_seqs=2, num_scheduler_steps=4)
  assert tokens == paged.generate(prompts, 9).tokens


def test_a_loop_of_the_trunk_gathers_and_settles_only_its_layers():
  """num_layers=1 of the 2: layer 0 ends as the paged loop leaves it, layer 1 as it was
  (a loop that never drafts leaves the MTP modules' layers in their pages)."""
  tables = jnp.asarray(_tables())
  pages, _ = _loop(_pool(), gather=False)
  loop_cache, settle = decode_loop_cache(_pool(), tables, "reference", num_layers=1)
  assert len(loop_cache.k) == len(loop_cache.v) == 1
  rng = np.random.default_rng(2)
  qkv = [jnp.asarray(rng.normal(size=(STEPS, L, 3, T, n, H)), jnp.float32) for n in (N, K, K)]
  q_lens, record = np.array([T, T, 1]), get_backend("reference")
  for step in range(STEPS):
    batch = make_step_batch(np.zeros((3, T), np.int32), STARTS + step * T, q_lens, tables)
    loop_cache, _ = loop_cache.attend(0, qkv[0][step, 0], qkv[1][step, 0], qkv[2][step, 0],
                                      batch, sm_scale=H ** -0.5, backend=record)
  with pytest.raises(IndexError):
    loop_cache.attend(1, qkv[0][0, 1], qkv[1][0, 1], qkv[2][0, 1], batch, sm_scale=H ** -0.5,
                      backend=record)
  settled = settle(loop_cache, jnp.asarray(STARTS), jnp.asarray(STARTS + (STEPS - 1) * T + q_lens),
                   STEPS * T)
  np.testing.assert_array_equal(np.asarray(settled.k_pages)[0, :, 1:],
                                np.asarray(pages.k_pages)[0, :, 1:])
  np.testing.assert_array_equal(np.asarray(settled.k_pages)[1], np.asarray(_pool().k_pages)[1])
  np.testing.assert_array_equal(np.asarray(settled.v_pages)[1], np.asarray(_pool().v_pages)[1])


def test_an_mtp_engine_bursting_without_drafts_gathers_only_the_trunk(monkeypatch):
  """k = 0 bursts of an MTP engine copy the trunk's layers, k = 2 bursts the MTP modules'
  too; the greedy tokens are plain decoding's either way."""
  from kvjax.caches.gathered import GatheredKVCache
  from kvjax.engine.sched.draft_policy import FixedDrafts

  model = kvjax.load_checkpoint()  # the default model: 4 trunk layers, 2 MTP modules
  gathered_layers = []
  gather = GatheredKVCache.gather.__func__
  monkeypatch.setattr(GatheredKVCache, "gather", classmethod(
      lambda cls, *args: gathered_layers.append(len(gather(cls, *args).k)) or gather(cls, *args)))
  # A backend record of its own name: the burst programs trace here, not from a cache.
  spy = dataclasses.replace(get_backend("reference"), name="reference+layers")
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  common = dict(backend=spy, max_num_seqs=2, num_scheduler_steps=4, speculative="mtp", num_draft=2)
  plain = kvjax.Engine(model, backend=spy, max_num_seqs=2, num_scheduler_steps=4).generate(
      prompts, 9).tokens
  trunk, every = model.config.cache_layers(False), model.config.num_cache_layers
  assert (trunk, every) == (4, 6)
  gathered_layers.clear()
  k0 = kvjax.Engine(model, draft_policy=FixedDrafts(0), **common).generate(prompts, 9).tokens
  assert gathered_layers and set(gathered_layers) == {trunk}
  gathered_layers.clear()
  k2 = kvjax.Engine(model, **common).generate(prompts, 9).tokens
  assert gathered_layers and set(gathered_layers) == {every}
  assert k0 == k2 == plain
