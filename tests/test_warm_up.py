"""Engine.warm_up: every step program compiled before serving, nothing a request reads changed.

Oracles: kvjax.runtime.serve_steps.num_compiled (a step that meets a new program raises
it), an engine that never warmed up (its tokens), the pages a fresh pool holds
(zeros), random row groups within the scheduler's limits (every one packs to
a listed shape), and shape counts worked out by hand from the bucketing rules.
"""
from __future__ import annotations

import types

import httpx
import jax
import numpy as np
import pytest

import kvjax
from kvjax.engine.sched.batching import Packing, StepShape
from kvjax.engine.warm_up import SERVER_VARIANTS
from kvjax.model.params import init_params
from kvjax.runtime.serve_steps import num_compiled
from kvjax.server import serve_in_thread
from tests.test_hybrid import CONFIG as HYBRID

# 4 rows, 16- and 32-token chunks, tables of 8 or 12 pages: 6 programs with bursts.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, page_size=8)


@pytest.fixture(scope="module")
def placed(tiny_model):
  """The tiny model with its params committed to the device, as a loaded checkpoint's are
  (its steps then return the engine state committed, unlike the fresh state)."""
  params = jax.device_put(tiny_model.params, jax.devices()[0])
  return kvjax.Model(tiny_model.config, params, tiny_model.dtype, tiny_model.tokenizer)


@pytest.fixture(scope="module")
def warmed(placed):
  """(engine, its WarmUp report, step programs jit's caches gained during it)."""
  engine = kvjax.Engine(placed, **SMALL)
  before = num_compiled()
  done = engine.warm_up()
  return engine, done, num_compiled() - before


def _prompts(seed: int, n: int, shared: int = 0) -> list[list[int]]:
  """n prompts of 1..44 ids (the first `shared` ids common to all: prefix hits)."""
  rng = np.random.default_rng(seed)
  prefix = rng.integers(3, 120, shared).tolist()
  return [prefix + rng.integers(3, 120, int(k)).tolist() for k in rng.integers(1, 45 - shared, n)]


# -- the shapes ----------------------------------------------------------------------------

def _packing(*, max_num_seqs, max_num_batched_tokens, page_size, max_model_len, num_draft):
  return Packing.create(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        page_size=page_size, max_pages_per_seq=-(-max_model_len // page_size),
                        num_draft=num_draft, max_model_len=max_model_len)


def _random_group(packing: Packing, kind: str, rng) -> tuple[list, np.ndarray]:
  """A row group the scheduler could plan -> (rows, block tables [rows, pages]), rows ducks
  of ScheduledRow: at most max_num_seqs rows within the token budget (a burst: 1 + J_max
  each), every fed or reserved position at most max_model_len - 2."""
  budget, last_fed, z = packing.max_num_batched_tokens, packing.max_model_len - 2, packing.page_size
  most_rows = budget // (1 + packing.num_draft) if kind == "burst" else budget
  rows, used = [], 0
  for _ in range(rng.integers(1, min(most_rows, packing.max_num_seqs) + 1)):
    if kind == "prefill":  # mostly short chunks, now and then one as long as allowed
      longest = min(budget - used, last_fed + 1) if rng.random() < 0.3 else 3
      n = int(rng.integers(1, max(1, min(longest, budget - used)) + 1))
    else:  # a decode row writes 1 + its drafts
      n = 1 + int(rng.integers(0, packing.num_draft + 1))
    if used + n > budget:
      break
    used += n
    start = int(rng.integers(0, last_fed + 2 - n))
    # Pages held: every position written; a burst's, every step's it reserved.
    written = int(rng.integers(n, last_fed + 2 - start)) if kind == "burst" else n
    rows.append(types.SimpleNamespace(is_decode=kind != "prefill", num_tokens=n, start=start,
                                      pages=-(-(start + written) // z)))
  tables = np.zeros((len(rows), -(-packing.max_model_len // z)), np.int32)
  for i, row in enumerate(rows):
    tables[i, :row.pages] = 7
  return rows, tables


PACKINGS = {
    "serve_http": dict(max_num_seqs=8, max_num_batched_tokens=512, page_size=16,
                       max_model_len=193, num_draft=0),
    "mtp, small pages": dict(max_num_seqs=12, max_num_batched_tokens=96, page_size=4,
                             max_model_len=100, num_draft=2),
    "tight budget": dict(max_num_seqs=4, max_num_batched_tokens=20, page_size=8,
                         max_model_len=64, num_draft=3),
}


@pytest.mark.parametrize("name", PACKINGS)
def test_every_group_the_scheduler_can_plan_packs_to_a_listed_shape(name):
  packing = _packing(**PACKINGS[name])
  counts = range(packing.num_draft + 1)
  listed = set(packing.shapes(counts, bursts=True))
  assert len(listed) == len(packing.shapes(counts, bursts=True))  # no shape twice
  rng = np.random.default_rng(0)
  for _ in range(3000):
    kind = ("prefill", "decode", "burst")[rng.integers(3)]
    j = int(rng.integers(0, packing.num_draft + 1))  # prefill rows draft any count too
    rows, tables = _random_group(packing, kind, rng)
    b, t = packing.shape(rows, j)
    shape = StepShape(kind, b, t, packing.table_width(tables, rows, t), j)
    assert shape in listed, (shape, [(r.start, r.num_tokens, r.pages) for r in rows])
    if kind == "prefill":  # what the engine launches: the group in pieces
      pieces = packing.prefill_pieces(rows)
      assert sorted(i for piece in pieces for i in piece) == list(range(len(rows)))
      padded = 0
      for piece in pieces:
        sub = [rows[i] for i in piece]
        pb, pt = packing.shape(sub, j)
        assert StepShape(kind, pb, pt, packing.table_width(tables[piece], sub, pt), j) in listed
        padded += pb * pt
      assert padded <= b * t


def test_prefill_pieces_pad_less_by_hand():
  packing = _packing(**PACKINGS["serve_http"])  # 128-token chunks: a 1-row bucket
  rows = [types.SimpleNamespace(is_decode=False, num_tokens=n) for n in (96, 128, 128, 32, 128)]
  # Longest first: 4 rows of 128 columns, then the 32-token chunk alone.
  assert packing.prefill_pieces(rows) == [[1, 2, 4, 0], [3]]
  assert [packing.shape([rows[i] for i in p]) for p in ([1, 2, 4, 0], [3])] == [
      (4, 128), (4, 32)]  # 640 padded tokens where one group pads 8 x 128 = 1,024
  # 16-column chunks pad to 8 rows anyway: one piece.
  short = [types.SimpleNamespace(is_decode=False, num_tokens=9) for _ in range(5)]
  assert packing.prefill_pieces(short) == [[0, 1, 2, 3, 4]]


def test_shapes_of_the_serve_http_engine_by_hand():
  # Chunks T 16 (rows bucket 8), 32 (4, 8), 64 (2, 4, 8), 128 and 256 (1, 2, 4, 8); a
  # chunk of T 512 is over 256 tokens, more than 192 fed positions: none.  Tables: a row
  # reads ceil((start + T) / 16) pages, start + T from T to 191 + T: W in {8, 16} up to
  # T 64, {8, 16, 32} at 128, {16, 32} at 256.  Decode rows T 1, B 8, W {8, 16}; bursts too.
  packing = _packing(**PACKINGS["serve_http"])
  expected = {16: 1 * 2, 32: 2 * 2, 64: 3 * 2, 128: 4 * 3, 256: 4 * 2}
  shapes = packing.shapes(bursts=True)
  prefill = [s for s in shapes if s.kind == "prefill"]
  assert {t: sum(s.columns == t for s in prefill) for t in expected} == expected
  assert len(prefill) == sum(expected.values())
  for kind in ("decode", "burst"):
    assert sorted((s.rows, s.columns, s.width) for s in shapes if s.kind == kind) == [
        (8, 1, 8), (8, 1, 16)]
  assert not [s for s in packing.shapes(bursts=False) if s.kind == "burst"]
  # An adaptive policy's draft counts {0, 2}: decode rows 1 and 3 wide.
  mtp = _packing(**{**PACKINGS["serve_http"], "num_draft": 2})
  assert {s.columns for s in mtp.shapes((0, 2)) if s.kind == "decode"} == {1, 3}
  # ... and prefill chunks drafting 0 or 2: the prefill family twice.
  one, both = ([s[:4] for s in mtp.shapes(c) if s.kind == "prefill"] for c in ((2,), (0, 2)))
  assert sorted(both) == sorted(one * 2) and {s.num_draft for s in mtp.shapes((0, 2))} == {0, 2}


def _avals(batch):
  return jax.tree.structure(batch), [(np.shape(x), np.asarray(x).dtype)
                                     for x in jax.tree.leaves(batch)]


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_padding_batches_have_the_packed_batches_structure(tiny_model, family):
  """What the jit cache keys on (pytree, shapes, dtypes) is the same for a padding batch
  as for the batch a real plan packs to: a hybrid's snapshot fields included."""
  # The packing never reads weights: the hybrid's are shapes only.
  model = tiny_model if family == "dense" else kvjax.Model(HYBRID, jax.eval_shape(
      lambda: init_params(HYBRID, jax.random.PRNGKey(0))))
  engine = kvjax.Engine(model, **SMALL)
  assert (engine.snapshots is not None) == (family == "hybrid")
  for prompt in _prompts(1, 3, shared=17):
    engine.add_request(prompt, 4)
  scheduler, kinds = engine.scheduler, set()
  for _ in range(4):
    plan = scheduler.schedule()
    snapshots = engine.snapshots and engine.snapshots.plan(plan.rows)
    for decode in (True, False):
      group = [i for i, r in enumerate(plan.rows) if r.is_decode == decode]
      if not group:
        continue
      batch = engine.packing.pack(plan, group, None, None, snapshots)
      kind = "prefill" if not decode else "burst" if plan.num_steps > 1 else "decode"
      shape = StepShape(kind, *batch.tokens.shape, batch.block_tables.shape[1],
                        engine.num_draft)
      assert shape in engine.packing.shapes(bursts=True)
      assert _avals(batch) == _avals(engine.packing.padding(shape, engine.snapshots is not None))
      kinds.add(kind)
    scheduler.update_from_output(plan, {r.request_id: [5] * (1 + r.num_draft) for r in plan.rows
                                        if r.sample})
    if engine.snapshots:
      engine.snapshots.settle()
  assert kinds == {"prefill", "decode", "burst"}


# -- warming up a real engine ----------------------------------------------------------------

def test_warm_up_runs_every_shape_and_writes_no_page_a_request_holds(warmed):
  engine, done, compiled = warmed
  # Two prefill chunk shapes at the widest table (prefill_full_width), a decode shape and
  # a burst per decode table width (one here).
  assert done.runs == len(engine.packing.shapes(bursts=True)) == 4
  assert done.programs == compiled  # what it reports is what jit's caches gained
  cache = engine.state.cache
  for pages in (cache.k_pages, cache.v_pages):  # [L, K, P, Z, H]: page 0 is the null page
    assert not np.asarray(pages)[:, :, 1:].any()
  assert not np.asarray(engine.state.drafts).any()
  assert not engine.steps.num_recorded and not engine.has_unfinished
  again = engine.warm_up()  # every program is compiled now: runs them all, compiles none
  assert (again.runs, again.programs) == (4, 0)


def test_after_warm_up_generate_compiles_nothing_and_equals_an_unwarmed_engine(warmed, placed):
  engine, _, _ = warmed
  prompts = _prompts(2, 6, shared=9)
  before = num_compiled()
  greedy = engine.generate(prompts, 12).tokens
  sampled = engine.generate(prompts[:3], 10, temperature=0.9, seed=[4, 5, 6]).tokens
  assert num_compiled() == before
  cold = kvjax.Engine(placed, **SMALL)
  assert cold.generate(prompts, 12).tokens == greedy
  assert cold.generate(prompts[:3], 10, temperature=0.9, seed=[4, 5, 6]).tokens == sampled


def test_prompt_logprobs_warm_up_compiles_the_scoring_prefill_programs(warmed):
  """prompt_logprobs=True adds one program per prefill shape (two here), after which a
  request scoring its prompt compiles nothing."""
  engine, _, _ = warmed
  done = engine.warm_up(prompt_logprobs=True)
  assert done.runs == 4 + 2 and done.programs == 2
  before = num_compiled()
  ids = [engine.add_request(p, 4, prompt_logprobs=2) for p in _prompts(7, 3)]
  outputs = [out for out in engine.stream() if out.prompt_logprobs is not None]
  assert sorted(out.request_id for out in outputs) == sorted(ids)
  assert num_compiled() == before


def _run_to_end(engine, requests) -> list[list[int]]:
  """Add (prompt, options) requests of 8 tokens, step until done -> their output ids."""
  ids = [engine.add_request(prompt, 8, **options) for prompt, options in requests]
  final = {}
  while engine.has_unfinished:
    final.update({out.request_id: out.output_ids for out in engine.step() if out.finished})
  return [final[i] for i in ids]


def test_penalties_min_tokens_and_logit_bias_after_warm_up_compile_nothing(warmed, placed):
  """Their rows carry active logit processing, every other group the neutral one: one
  program serves both, so a request's first penalty waits on no compile; and the cond
  that skips inactive processing does apply active processing (their tokens differ from
  the same prompts' without it)."""
  engine, _, _ = warmed
  prompts = _prompts(5, 3)
  options = [dict(repetition_penalty=1.8, frequency_penalty=0.7),
             dict(min_tokens=6, presence_penalty=1.1), dict(logit_bias={7: 9.0, 11: 4.0})]
  before = num_compiled()
  processed = _run_to_end(engine, [*zip(prompts, options), (prompts[0], {})])
  assert num_compiled() == before
  plain = kvjax.Engine(placed, **SMALL).generate(prompts, 8).tokens
  assert processed[3] == plain[0]  # the neutral row beside them
  assert all(got != want for got, want in zip(processed[:3], plain))


def test_every_sampling_option_after_a_servers_warm_up_compiles_nothing(placed):
  """A server's engine (one step a call) warmed as a server warms it: requests asking for
  every sampling option a client can send, side by side, run the warm-up's programs."""
  engine = kvjax.Engine(placed, **SMALL, num_scheduler_steps=1)
  engine.warm_up(**SERVER_VARIANTS)
  before = num_compiled()
  prompts = _prompts(8, 8)
  options = [dict(temperature=0.8, top_p=0.9, seed=1), dict(temperature=1.0, top_k=5, seed=2),
             dict(logprobs=3), dict(stop=[7, 9, 11]), dict(min_tokens=4, ignore_eos=True),
             dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
             dict(logit_bias={5: 3.0}, temperature=0.7, top_p=0.5, top_k=9, seed=3, logprobs=1),
             {}]
  outputs = _run_to_end(engine, list(zip(prompts, options)))
  assert num_compiled() == before
  assert len(outputs[4]) == 8  # ignore_eos: the full length


def test_a_mixed_stream_after_warm_up_compiles_nothing(warmed):
  """Arrivals mid-run (prefill beside decode), chunked long prompts, prefix hits, bursts,
  an abort, sampled and greedy rows: every step program was compiled by the warm-up."""
  engine, _, _ = warmed
  rng = np.random.default_rng(3)
  arrivals = {0: 2, 1: 1, 3: 3, 6: 1, 9: 2, 15: 1, 30: 2}
  before, mark, step, ids = num_compiled(), engine.steps.num_recorded, 0, []
  hits = engine.scheduler.prefix_cache.hit_tokens
  while step <= max(arrivals) or engine.has_unfinished:
    for prompt in _prompts(step, arrivals.get(step, 0), shared=int(rng.integers(0, 20))):
      ids.append(engine.add_request(prompt, int(rng.integers(1, 64 - len(prompt))),
                                    temperature=float(rng.choice([0.0, 0.8])),
                                    seed=int(rng.integers(100))))
    if step == 4:
      engine.abort(ids[1])
    engine.step()
    step += 1
  assert num_compiled() == before
  log = engine.steps.since(mark)  # what the stream ran: all of it, else the test is weak
  assert {t for groups in log.row_shapes for _, t in groups} == {1, 16, 32}
  assert any(len(groups) == 2 for groups in log.row_shapes)  # prefill beside decode
  assert max(log.num_steps) > 1  # a burst
  assert engine.scheduler.prefix_cache.hit_tokens > hits


def test_one_program_serves_every_sampling_option(tiny_model):
  """After a plain warm-up, requests with top-k, top-p, logprobs and all of them at once
  compile nothing (runtime conds, kvjax/runtime/serve_steps.py), and their outputs equal a cold
  engine's (which compiles as it goes)."""
  options = [dict(top_k=3), dict(temperature=0.7, top_p=0.9, logprobs=2, seed=1), dict(logprobs=0),
             dict(temperature=1.0, top_k=5, top_p=0.8, logprobs=1, seed=9), {}]
  shapes = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=16,
                num_scheduler_steps=1)  # prefill (4, 16, 5), decode (4, 1, 5)

  def run(engine):
    ids = [engine.add_request([5 + i, 6, 7], 4, **o) for i, o in enumerate(options)]
    finals, logprobs = {}, {i: [] for i in ids}
    for out in engine.stream():
      logprobs[out.request_id] += out.new_logprobs or []
      if out.finished:
        finals[out.request_id] = out.output_ids
    return [(finals[i], logprobs[i]) for i in ids]

  warm = kvjax.Engine(tiny_model, **shapes)
  assert warm.warm_up().runs == 2
  before = num_compiled()
  got = run(warm)
  assert num_compiled() == before
  assert got == run(kvjax.Engine(tiny_model, **shapes))
  assert all(len(lp) == 4 for _, lp in got[1:4]) and got[0][1] == got[4][1] == []


def test_a_full_warm_up_server_serves_without_compiling(placed, warmed, released_programs):
  engine, _, _ = warmed
  with pytest.raises(ValueError, match="warm_up must be one of"):
    serve_in_thread(placed, kvjax.EngineConfig(**SMALL), warm_up="some")
  with serve_in_thread(placed, kvjax.EngineConfig(**SMALL), warm_up="full") as server:
    # One program a shape, bursts in 3 stop-id widths.
    kinds = [shape.kind for shape in engine.packing.shapes(bursts=True)]
    bursts = kinds.count("burst")
    assert bursts and len(kinds) > bursts
    assert server.warm_up.runs == len(kinds) + 2 * bursts
    before = num_compiled()
    for prompt in _prompts(4, 3):
      answer = httpx.post(server.url + "/completions", timeout=60,
                          json={"model": server.model_name, "prompt": prompt, "max_tokens": 8})
      assert answer.status_code == 200, answer.text
    assert num_compiled() == before


def test_progress_bar_adds_up(capsys):
  from kvjax.engine.warm_up import WarmUpPlan, warm_up

  shapes = [StepShape("burst", 4, 1, 8, 0), StepShape("prefill", 4, 16, 8, 0)]
  calls = []
  plan = WarmUpPlan(shapes, lambda *args: calls.append(args), stop_widths=(1, 2))
  done = warm_up(plan, progress="warm-up")
  err = capsys.readouterr().err
  # the burst in 2 stop widths, the prefill once; + 1: the settling run, outside the bar.
  assert len(calls) == done.runs + 1 == 4
  # E = 1 ones first; the third argument: scoring prompt columns (no prompt_logprobs here)
  assert calls[1:] == [(shapes[0], 1, False), (shapes[1], 1, False), (shapes[0], 2, False)]
  assert "3/3" in err and "4/3" not in err
  assert done.programs == 0  # nothing here compiles
