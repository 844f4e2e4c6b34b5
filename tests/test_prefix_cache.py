"""PrefixCache (claim C8): full-block sharing, salts, token-mode reuse, LRU."""
import pytest

from kvjax.engine.sched.pages import BlockAllocator
from kvjax.engine.sched.prefix_cache import PrefixCache, hash_block, root_hash


def _cache(num_pages=32, page_size=16, **kw):
  return PrefixCache(BlockAllocator(num_pages), page_size, **kw)


def _compute(cache, tokens, salt=None):
  """What a finished request leaves behind: its full blocks, cached."""
  g = cache.page_size
  pages = cache.allocator.allocate(-(-len(tokens) // g))
  hashes = cache.block_hashes(tokens, len(tokens) // g, salt)
  parent = root_hash(salt)
  for i, h in enumerate(hashes):
    cache.insert(h, parent, tokens[i * g:(i + 1) * g], pages[i])
    parent = h
  return pages


def _release(cache, pages):
  cache.allocator.decref(reversed(pages))


PREFIX = list(range(100, 130))  # the 30-token shared prefix of claim C8

# name: (page_size, prefix_match, cached prompt, queried prompt, hit tokens)
C8_SCENARIOS = {
    "page64_block_zero_hits": (64, "block", PREFIX, PREFIX, 0),
    "page64_token_nothing_full_to_copy": (64, "token", PREFIX, PREFIX, 0),
    "page16_block_one_block": (16, "block", PREFIX, PREFIX, 16),
    # The cached request's partial tail block was never full, so not cached.
    "page16_token_partial_tail_not_cached": (16, "token", PREFIX, PREFIX, 16),
    "page16_block_shared_prefix": (16, "block", PREFIX + [1, 2, 3],
                                   PREFIX + [7, 8, 9], 16),
    "page16_token_shared_prefix": (16, "token", PREFIX + [1, 2, 3],
                                   PREFIX + [7, 8, 9], 30),
    "timestamp_kills_every_hit": (16, "token", PREFIX + [1, 2, 3],
                                  [99] + PREFIX[1:] + [1, 2, 3], 0),
    "exact_two_blocks_block_mode": (16, "block", PREFIX + [1, 2],
                                    PREFIX + [1, 2], 16),
    "exact_two_blocks_token_mode": (16, "token", PREFIX + [1, 2],
                                    PREFIX + [1, 2], 31),
}


@pytest.mark.parametrize("name", C8_SCENARIOS)
def test_c8_hits(name):
  page_size, mode, cached, queried, expected = C8_SCENARIOS[name]
  cache = _cache(page_size=page_size, prefix_match=mode)
  _release(cache, _compute(cache, cached))
  hit = cache.lookup(queried)
  assert hit.num_tokens == expected
  assert hit.num_tokens <= len(queried) - 1
  assert len(hit.pages) * page_size + hit.copy_tokens == hit.num_tokens
  cache.check_invariants()


def test_token_mode_returns_the_page_to_copy():
  cache = _cache(prefix_match="token")
  pages = _compute(cache, PREFIX + [1, 2, 3])
  hit = cache.lookup(PREFIX + [7, 8, 9])
  assert hit.pages == (pages[0],)
  assert (hit.copy_src, hit.copy_tokens) == (pages[1], 14)


def test_token_mode_picks_the_longest_sibling():
  cache = _cache(prefix_match="token")
  base = list(range(16))
  a = _compute(cache, base + [1] * 5 + [0] * 11)
  b = _compute(cache, base + [1] * 9 + [0] * 7)
  hit = cache.lookup(base + [1] * 12 + [5])
  assert hit.pages == (a[0],)
  assert (hit.copy_src, hit.copy_tokens) == (b[1], 9)


def test_salts_isolate_tenants():
  cache = _cache(prefix_match="token")
  prompt = PREFIX + [1, 2, 3]
  _compute(cache, prompt, salt="tenant-a")
  assert cache.lookup(prompt, "tenant-a").num_tokens == 32
  for other in (None, "tenant-b"):
    hit = cache.lookup(prompt, other)
    assert hit.num_tokens == 0 and hit.copy_src is None


def test_hash_chain_covers_parent_tokens_and_extra_keys():
  base = hash_block(b"p", [1, 2], ("s",))
  assert base == hash_block(b"p", [1, 2], ("s",))
  assert len({base, hash_block(b"q", [1, 2], ("s",)),
              hash_block(b"p", [1, 3], ("s",)),
              hash_block(b"p", [1, 2], ("t",))}) == 4
  assert root_hash("a") != root_hash(None)


def test_lru_evicts_tail_blocks_first():
  cache = _cache(num_pages=5, page_size=4)  # 4 usable pages
  prompt = list(range(13))  # 3 full blocks + 1 token
  _release(cache, _compute(cache, prompt))
  assert cache.num_cached_pages == 3
  assert cache.lookup(prompt).num_tokens == 12
  cache.allocator.allocate(2)  # the free partial page, then the deepest block
  assert cache.lookup(prompt).num_tokens == 8
  cache.allocator.allocate(1)
  assert cache.lookup(prompt).num_tokens == 4
  cache.check_invariants()


def test_lru_keeps_recently_hit_prefixes():
  cache = _cache(num_pages=8, page_size=4)  # 7 usable pages
  a, b = list(range(9)), list(range(50, 59))  # 2 full blocks + 1 token each
  _release(cache, _compute(cache, a))
  _release(cache, _compute(cache, b))
  hit = cache.lookup(a)  # a is touched again: now b is least recent
  cache.acquire(hit)
  _release(cache, list(hit.pages))
  cache.allocator.allocate(5)  # 3 plain free pages, then b's 2 blocks
  assert cache.lookup(a).num_tokens == 8
  assert cache.lookup(b).num_tokens == 0
  cache.check_invariants()


def test_min_cacheable_tokens_and_hit_rate():
  cache = _cache(min_cacheable_tokens=32)
  _release(cache, _compute(cache, PREFIX + [1, 2, 3, 4, 5, 6]))
  short = cache.lookup(PREFIX + [1, 9])  # 16 hit tokens < 32: discarded
  assert short.num_tokens == 0 and not short.pages
  long = cache.lookup(PREFIX + [1, 2, 3, 4, 5, 6])
  assert long.num_tokens == 32
  cache.acquire(short)
  cache.acquire(long)
  assert (cache.hit_tokens, cache.queried_tokens) == (32, 32 + 36)
  assert cache.hit_rate == pytest.approx(32 / 68)


def test_duplicate_blocks_stay_private_and_reset_forgets_all():
  cache = _cache()
  first = _compute(cache, PREFIX)
  second = cache.allocator.allocate(1)
  h = cache.block_hashes(PREFIX, 1)[0]
  assert not cache.insert(h, root_hash(None), PREFIX[:16], second[0])
  assert not cache.allocator.is_cached(second[0])
  _release(cache, first)
  cache.reset()
  assert cache.num_cached_pages == 0 and cache.allocator.num_evictable == 0
  assert cache.lookup(PREFIX).num_tokens == 0
  cache.check_invariants()


def test_rejects_bad_arguments():
  with pytest.raises(ValueError, match="prefix_match"):
    _cache(prefix_match="tokens")
  with pytest.raises(ValueError, match="page_size"):
    _cache(page_size=0)
