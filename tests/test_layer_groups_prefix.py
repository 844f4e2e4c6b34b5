"""The prefix cache per KV layer group (kvjax/engine/sched/group_pages.py).

The random 4-layer 'tiny' of tests/test_layer_groups.py (windows W, W, None, W: group 0
the sliding layers, group 1 the global one), page size G.  Request A computes a prompt
several windows long; request B shares it and resumes from the cache.  The sliding group
released A's early pages as its window passed them (cached, evictable), so B resumes at
L only where the sliding group still caches every block the window sees at L.  The oracle
is an engine with one pool and no prefix cache (its tokens are also kvjax.generate's): the
same greedy tokens and top-5 logprobs.  A sliding group resuming on pages it does not
hold (or on another group's) would read the null page or wrong keys inside its window.
The last test checks the hit rule alone, on host pools whose global, sliding or sink
group lost blocks.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import kvjax
from kvjax.caches.layout import PageRelease, WindowRelease
from kvjax.engine.requests import Request
from kvjax.engine.sched.group_pages import GroupPages
from kvjax.engine.sched.pages import NULL_PAGE
from kvjax.engine.sched.prefix_cache import PrefixCache, root_hash

from tests.test_layer_groups import ENGINE, G, W, _model, _record_groups

GROUPED = {**ENGINE, "prefix_cache": True}
ONE_POOL = {**ENGINE, "kv_groups": False}
SHARED = [(11 * i + 5) % 500 for i in range(40)]  # 10 blocks, 5 windows
A = (SHARED, 4)
B = (SHARED + [(13 * i + 7) % 500 for i in range(9)], 8)  # hits up to all 40 shared tokens
FILLER = ([(17 * i + 2) % 500 for i in range(60)], 6)  # no block in common with SHARED
AGAIN = (SHARED, 3)  # A's prompt: a hit leaves its last token to compute, so 36 of 40


def _serve(eng, requests) -> list[tuple[list, list, int]]:
  """Each (prompt, max_new_tokens) alone, in turn -> (its tokens, the top-5 logprobs of
  each, its prefix-hit tokens)."""
  served = []
  for prompt, max_new_tokens in requests:
    rid = eng.add_request(prompt, max_new_tokens, logprobs=5)
    tokens, logprobs, finished = [], [], None
    while finished is None:
      for out in eng.step():
        assert out.request_id == rid
        tokens += out.new_token_ids
        logprobs += [[lp for _, lp in token.top] for token in out.new_logprobs]
        finished = out if out.finished else None
    served.append((tokens, logprobs, finished.metrics.prefix_hit_tokens))
  return served


def _assert_exact(served, requests):
  """Tokens and logprobs equal the one-pool engine's without a prefix cache, and the
  tokens kvjax.generate's."""
  oracle = _serve(kvjax.Engine(_model(), **ONE_POOL), requests)
  for (tokens, logprobs, _), (want, want_logprobs, _) in zip(served, oracle):
    assert tokens == want
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
  for (prompt, max_new_tokens), (tokens, _, _) in zip(requests, served):
    assert tokens == kvjax.generate(_model(), [prompt], max_new_tokens,
                                    cache="none").tokens[0]


def _assert_every_page_free_or_cached(eng):
  eng.scheduler.check_invariants()
  assert [g.allocator.num_used for g in eng.scheduler.groups] == [0, 0]
  assert all(g.prefix_cache.num_cached_pages for g in eng.scheduler.groups)


def _global_hit(eng, prompt) -> int:
  """Tokens the global group alone would reuse (its longest cached prefix)."""
  return eng.scheduler.groups[1].prefix_cache.lookup(prompt).num_tokens


def test_a_shared_prefix_resumes_every_group():
  """FILLER first, so A's blocks sit in different pages in the two pools (recycled in the
  small sliding one): a group resuming on another group's pages reads wrong keys."""
  eng = kvjax.Engine(_model(), **GROUPED)
  _record_groups(eng)
  served = _serve(eng, [FILLER, A, B, AGAIN])
  assert [hit for *_, hit in served] == [0, 0, len(SHARED), len(SHARED) - G]
  assert eng.stats().prefix_hit_tokens == 2 * len(SHARED) - G
  _assert_exact(served, [FILLER, A, B, AGAIN])
  _assert_every_page_free_or_cached(eng)


def test_a_hit_the_window_does_not_cover_falls_back_to_a_shorter_one():
  """The sliding group lost block 8, the first its window sees at 40 (keys 33 .. 39), as
  eviction would: at 36 the window sees it too, so B resumes at 32 (blocks 6, 7 cached)."""
  eng = kvjax.Engine(_model(), **GROUPED)
  _record_groups(eng)
  served = _serve(eng, [A])
  sliding = eng.scheduler.groups[0].prefix_cache
  first_seen = (len(SHARED) - W + 1) // G
  assert first_seen == 8
  block = sliding.block_hashes(SHARED, first_seen + 1)[first_seen]
  sliding.discard([sliding.page_of(block)])
  assert _global_hit(eng, B[0]) == len(SHARED)
  served += _serve(eng, [B])
  assert served[1][2] == 32
  _assert_exact(served, [A, B])
  _assert_every_page_free_or_cached(eng)


def test_a_sliding_group_whose_blocks_were_evicted_computes_the_prompt():
  """Between A and B another prompt takes the small sliding pool: A's sliding blocks are
  evicted (the released ones first), the global pool still caches all of them."""
  eng = kvjax.Engine(_model(), **GROUPED)
  _record_groups(eng)
  served = _serve(eng, [A, FILLER])
  assert _global_hit(eng, B[0]) == len(SHARED)
  served += _serve(eng, [B])
  assert served[2][2] == 0
  _assert_exact(served, [A, FILLER, B])
  _assert_every_page_free_or_cached(eng)


def test_a_router_sees_the_hit_every_group_serves():
  """The global group lost block 5: the engine resumes B at 20 however much the sliding
  group (group 0) caches, and the scheduler's `cached_prefix` (what a Router routes by)
  says the same before B is added."""
  eng = kvjax.Engine(_model(), **GROUPED)
  served = _serve(eng, [A])
  glob = eng.scheduler.groups[1].prefix_cache
  glob.discard([glob.page_of(glob.block_hashes(SHARED, 6)[5])])
  assert eng.scheduler.groups[0].prefix_cache.lookup(B[0]).num_tokens == len(SHARED)
  router = kvjax.Router([eng])
  assert eng.scheduler.cached_prefix(B[0]) == router.cached_prefix(0, B[0]) == 5 * G
  served += _serve(eng, [B])
  assert served[1][2] == 5 * G
  _assert_exact(served, [A, B])


def test_token_prefix_match_is_refused_by_name():
  with pytest.raises(ValueError, match="prefix_match"):
    kvjax.Engine(_model(), **GROUPED, prefix_match="token")


# -- the hit rule alone, on host pools (no model) ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class _SinkRelease(PageRelease):
  """A window that keeps page 0 (an attention sink): its dead pages are a tuple with a
  live page before them, as a variant mask's release gives (kvjax/engine/sched/mask_release.py)."""

  window: int = W

  def dead_pages(self, start: int) -> tuple:
    return tuple(range(1, max(0, start - self.window + 1) // self.page_size))


def _cached_groups(releases, num_blocks: int):
  """GroupPages whose every group caches blocks 0 .. num_blocks - 1 of SHARED, held by
  nobody -> (the groups, the blocks' hashes)."""
  groups = GroupPages([(num_blocks + 1, release) for release in releases], G, 64, 16,
                      functools.partial(PrefixCache, page_size=G))
  hashes = groups.prefix_caches[0].block_hashes(SHARED, num_blocks)
  for cache in groups.prefix_caches:
    pages = cache.allocator.allocate(num_blocks)
    for i, page in enumerate(pages):
      cache.insert(hashes[i], hashes[i - 1] if i else root_hash(), SHARED[i * G:(i + 1) * G],
                   page)
    cache.allocator.decref(pages)
  return groups, hashes


@pytest.mark.parametrize("releases, lost, want", [
    # A global group lost block 5: nothing from 5 on.
    ((WindowRelease(G, W), PageRelease(G)), {1: [5]}, 20),
    # The sliding group lost its released blocks 0 .. 7: the window at 40 needs 8 and 9 only.
    ((WindowRelease(G, W), PageRelease(G)), {0: range(8)}, 40),
    # ... and block 9 too: no L <= 40 has its window blocks.
    ((WindowRelease(G, W), PageRelease(G)), {0: [*range(8), 9]}, 0),
    # A sink group needs block 0 as well as its window's.
    ((_SinkRelease(G), PageRelease(G)), {0: range(1, 8)}, 40),
    ((_SinkRelease(G), PageRelease(G)), {0: [0]}, 0),
])
def test_the_hit_is_the_longest_every_group_serves(releases, lost, want):
  groups, hashes = _cached_groups(releases, len(SHARED) // G)
  for group, blocks in lost.items():
    cache = groups[group].prefix_cache
    cache.discard([cache.page_of(hashes[i]) for i in blocks])
  req = Request("b", tuple(B[0]), 1)
  hits = groups.lookup(req)
  assert [hit.num_tokens for hit in hits] == [want] * len(releases)
  for group, hit in zip(groups, hits):
    dead = set(group.page_release.dead_pages(want))
    # A cached page for every block the group still reads from the hit on; the null page
    # only for a lost block it no longer reads.
    assert [i for i, page in enumerate(hit.pages) if page == NULL_PAGE] == \
        sorted(dead.intersection(lost.get(group.group, ())))
