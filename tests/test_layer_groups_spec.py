"""Speculative decoding with KV pages per layer group (EngineConfig.kv_groups, issue 50).

A verify step writes its draft columns' K/V into every group's pool through the group's
block table; the host then rolls back, in every group, the pages reserved for rejected
drafts, and a sliding group releases only the pages behind the window of the accepted
position.  The model: the built-in trained byte model (it copies repeated text, so n-gram
and MTP drafts are accepted) with windows (W, W, None, W): a sliding group (layers 0, 1,
3) and a global one (layer 2, and the MTP modules' layers, which attend globally).  The
oracles: the no-cache forward (`kvjax.generate(cache="none")`), the grouped engine
without speculation and the one-pool engine with it.  Prompts are longer than the window
and the runs long enough that the sliding group recycles its pages mid-run.
"""
from __future__ import annotations

import functools

import pytest

import kvjax
from kvjax.caches.groups import GroupedKVCache, layer_groups
from kvjax.engine.sched.pages import NULL_PAGE

W, G = 8, 4  # sliding window, page size
BUDGET = 16
ENGINE = dict(page_size=G, max_num_seqs=2, max_num_batched_tokens=BUDGET, max_model_len=256,
              prefix_cache=False, kv_groups=True, num_scheduler_steps=1)
TEXTS = ["x = f(x)\nx = f(x)\nx = f(x)\nx = f(", "for i in a:\n  s += i\nfor j in a:\n  s"]
NEW = 40


@functools.lru_cache(maxsize=None)
def _model() -> kvjax.Model:
  """The byte model (2 MTP modules) with sliding layers 0, 1, 3; EOS off: fixed lengths."""
  base = kvjax.load_checkpoint()
  cfg = base.config.replace(name="groups-byte", eos_token_id=None, layer_windows=(W, W, None, W))
  return kvjax.Model(cfg, base.params, base.dtype, base.tokenizer)


@functools.lru_cache(maxsize=None)
def _prompts() -> tuple:
  return tuple(tuple(_model().tokenizer.encode(text)) for text in TEXTS)


@functools.lru_cache(maxsize=None)
def _run(**options) -> tuple:
  """Greedy NEW tokens of every prompt from an Engine with ENGINE overridden by options."""
  eng = kvjax.Engine(_model(), **{**ENGINE, **options})
  return tuple(map(tuple, eng.generate([list(p) for p in _prompts()], NEW).tokens))


def _bound(n: int) -> int:
  """Sliding pages a row of n positions holds (tests/test_layer_groups.py): the window's
  and the row's, however long the request."""
  return -(-(W + n - 2) // G) + 1


def _live(pages) -> int:
  return sum(p != NULL_PAGE for p in pages)


def _checked(eng) -> list:
  """Every group's invariants checked after every schedule and every step (and after a step,
  each running request's tables cover its tokens, no more); per scheduled row, (positions
  it writes, sliding pages, global pages, its end position)."""
  held, schedule, step = [], eng.scheduler.schedule, eng.step

  def schedule_and_record(*args, **kwargs):
    plan = schedule(*args, **kwargs)
    eng.scheduler.check_invariants()
    held.extend((row.num_tokens, _live(row.request.pages), _live(row.request.group_pages[0]),
                 row.start + row.num_tokens) for row in plan.rows)
    return plan

  def step_and_check():
    outputs = step()
    eng.scheduler.check_invariants()
    for group in eng.scheduler.groups:  # no group keeps a page reserved for a rejected draft
      assert all(len(group.table(r)) <= group.pages_for(r.num_tokens)
                 for r in eng.scheduler.running)
    return outputs

  eng.scheduler.schedule, eng.step = schedule_and_record, step_and_check
  return held


def test_mtp_layers_join_the_group_of_their_window():
  cfg = _model().config
  assert [(g.window, g.layers) for g in layer_groups(cfg, with_mtp=True)] == [
      (W, (0, 1, 3)), (None, (2, 4, 5))]
  assert [g.layers for g in layer_groups(cfg)] == [(0, 1, 3), (2,)]


@pytest.mark.slow  # minutes on 2 shared cores: four engines' programs compile
@pytest.mark.parametrize("speculative, options", [
    ("ngram", dict(num_draft=4)),
    ("mtp", dict(num_draft=2, num_scheduler_steps=4)),  # drafts verified in device bursts
], ids=["ngram", "mtp-bursts"])
def test_speculation_with_groups_equals_the_forward_and_one_pool(speculative, options):
  model, prompts = _model(), [list(p) for p in _prompts()]
  assert all(len(p) > 3 * W for p in prompts)
  want = kvjax.generate(model, prompts, NEW, cache="none").tokens
  eng = kvjax.Engine(model, **{**ENGINE, "speculative": speculative, **options})
  assert isinstance(eng.state.cache, GroupedKVCache)
  held = _checked(eng)
  ids = [eng.add_request(p, NEW) for p in prompts]
  finals = {out.request_id: out for out in eng.stream() if out.finished}
  tokens = [list(finals[rid].output_ids) for rid in ids]
  assert tokens == want
  assert tokens == [list(t) for t in _run()]  # the grouped engine without speculation
  assert tokens == [list(t) for t in _run(speculative=speculative, kv_groups=False,
                                          **options)]
  assert sum(sum(finals[rid].metrics.accepted) for rid in ids) > 0  # drafts were accepted
  verify = [row for row in held if 1 < row[0] <= 1 + eng.num_draft]
  assert verify and all(sliding <= _bound(n) for n, sliding, _, _ in held)
  # The sliding group recycled pages mid-run while the global group kept every page, and
  # neither kept one reserved for a rejected draft: ceil(end / G) global pages per row.
  assert max(glob for _, _, glob, _ in held) > 2 * max(sliding for _, sliding, _, _ in held)
  assert [glob for _, _, glob, _ in held] == [-(-end // G) for *_, end in held]
  assert [g.allocator.num_used for g in eng.scheduler.groups] == [0, 0]


@pytest.mark.slow  # over a minute on 2 shared cores (compiles included)
def test_speculation_with_groups_preempts_and_hits_the_prefix_cache():
  """Pools too small for both requests: a preempted request's pages leave every group
  (to each group's prefix cache, from which it resumes)."""
  prompts = [list(p) for p in _prompts()] * 2
  eng = kvjax.Engine(_model(), **{**ENGINE, "speculative": "ngram", "num_pages": 24,
                                  "prefix_cache": True, "max_num_seqs": 3})
  _checked(eng)
  assert eng.generate(prompts, NEW).tokens == \
      kvjax.generate(_model(), prompts, NEW, cache="none").tokens
  assert eng.scheduler.num_preemptions > 0 and eng.stats().prefix_hit_tokens > 0
  assert [g.allocator.num_used for g in eng.scheduler.groups] == [0, 0]


def test_a_draft_model_with_groups_is_refused_by_name():
  with pytest.raises(ValueError, match="kv_groups does not support a draft model"):
    kvjax.Engine(_model(), **ENGINE, speculative=_model(), num_draft=2)
