"""serve --kv-events: a subscriber that replays the vLLM-format events ends with exactly
the blocks the engine's prefix cache holds.

Oracles: the prefix cache's own pages and hashes after a workload that fills and evicts
a small pool (PrefixCache.hash_of over every page), vLLM's wire layout decoded by
msgpack by hand (frames, sequence numbers, tagged arrays), and the prompts' own tokens
for every stored block's token_ids."""
from __future__ import annotations

import time

import numpy as np
import pytest

import kvjax
from kvjax.engine.kv_events import KVEventPublisher, external_hash

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

PAGE = 8


@pytest.fixture(scope="module")
def replayed(tiny_model, tmp_path_factory):
  """A workload of shared-prefix prompts on an 11-page pool (evictions), published to a
  subscriber -> (the engine, the decoded batches by sequence number, the prompts)."""
  endpoint = f"ipc://{tmp_path_factory.mktemp('kv-events')}/events"  # the publisher binds
  engine = kvjax.Engine(tiny_model, max_num_seqs=2, max_num_batched_tokens=32,
                        max_model_len=64, page_size=PAGE, num_pages=12)
  publisher = KVEventPublisher(endpoint, PAGE, flush_s=1.0)  # its first flush after 1 s
  sub = zmq.Context.instance().socket(zmq.SUB)
  sub.setsockopt(zmq.SUBSCRIBE, b"")
  sub.connect(endpoint)
  time.sleep(0.5)  # PUB/SUB: the subscription must reach the publisher before events do
  publisher.attach(engine.scheduler.prefix_cache)
  rng = np.random.default_rng(0)
  prefixes = [rng.integers(3, 120, 24).tolist() for _ in range(6)]  # 18 blocks > 11 pages
  prompts = [prefixes[i % 6] + rng.integers(3, 120, int(rng.integers(1, 12))).tolist()
             for i in range(12)]
  for start in range(0, len(prompts), 2):
    engine.generate(prompts[start:start + 2], 6)
  publisher.close()
  batches = {}
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    if not sub.poll(500):
      break
    topic, seq, payload = sub.recv_multipart()
    assert topic == b""
    batches[int.from_bytes(seq, "big")] = msgpack.unpackb(payload)
  sub.close()
  return engine, batches, prompts


def test_the_replayed_events_are_the_cached_blocks(replayed):
  engine, batches, _ = replayed
  assert sorted(batches) == list(range(len(batches)))  # none lost, in order from 0
  cached, removals = set(), 0
  for seq in sorted(batches):
    ts, events, rank = batches[seq]
    assert rank == 0 and ts > 0
    for event in events:
      if event[0] == "AllBlocksCleared":
        cached.clear()
      elif event[0] == "BlockStored":
        cached.update(event[1])
      else:
        assert event[0] == "BlockRemoved" and event[2] == "GPU"
        cached.difference_update(event[1])
        removals += len(event[1])
  cache = engine.scheduler.prefix_cache
  held = {external_hash(h) for h in map(cache.hash_of, range(engine.config.num_pages)) if h}
  assert removals > 0 and held and cached == held
  assert batches[0][1][0] == ["AllBlocksCleared"]


def test_stored_blocks_carry_their_tokens_and_parents(replayed):
  _, batches, prompts = replayed
  known = {}  # block key -> its tokens from the request's start
  for seq in sorted(batches):
    for event in batches[seq][1]:
      if event[0] != "BlockStored":
        continue
      tag, keys, parent, tokens, block_size, lora_id, medium, lora_name = event
      assert block_size == PAGE and len(tokens) == PAGE * len(keys)
      assert lora_id is None and lora_name is None and medium == "GPU"
      prefix = [] if parent is None else known[parent]
      for i, key in enumerate(keys):
        prefix = prefix + tokens[i * PAGE:(i + 1) * PAGE]
        known[key] = prefix
      # The chain from the request's start agrees with a prompt as far as both go (past
      # it: generated tokens).
      assert any(p[:len(prefix)] == prefix[:len(p)] for p in prompts)


def test_a_server_publishes_its_prefix_cache(tiny_model, tmp_path):
  import httpx

  from kvjax.server import serve_in_thread

  endpoint = f"ipc://{tmp_path}/server-events"
  config = kvjax.EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64,
                              page_size=PAGE)
  with serve_in_thread(tiny_model, config, kv_events=endpoint) as server:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.5)
    prompt = list(range(10, 30))  # 2 full blocks
    answer = httpx.post(server.url + "/completions", timeout=60, json={
        "model": server.model_name, "prompt": prompt, "max_tokens": 2})
    assert answer.status_code == 200
    stored = []
    while sub.poll(2000):
      _, _, payload = sub.recv_multipart()
      stored += [e for e in msgpack.unpackb(payload)[1] if e[0] == "BlockStored"]
      if sum(len(e[1]) for e in stored) >= 2:
        break
    sub.close()
  assert stored[0][2] is None and stored[0][3][:2 * PAGE] == prompt[:2 * PAGE]


@pytest.mark.slow
def test_a_serve_process_publishes_exactly_its_prompts_blocks(tmp_path):
  """`python -m kvjax serve --kv-events`: the replayed events are exactly the full blocks
  of the prompts sent (each 2 blocks + a tail the 1 generated token does not complete),
  shared first blocks stored once."""
  from tests.gateway_servers import TINY, ServeProcess

  endpoint = f"ipc://{tmp_path}/serve-events"
  block = 16  # TINY's page size
  rng = np.random.default_rng(1)
  blocks = [rng.integers(3, 120, block).tolist() for _ in range(5)]
  prompts = [blocks[0] + blocks[1], blocks[0] + blocks[2], blocks[3] + blocks[4]]
  with ServeProcess([*TINY, "--warm-up", "minimal", "--kv-events", endpoint]) as server:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.5)  # PUB/SUB: the subscription must reach the publisher before events do
    for prompt in prompts:
      server.complete(prompt + rng.integers(3, 120, 5).tolist(), max_tokens=1)
    live: dict = {}  # block hash -> its tokens from the request's start
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and sub.poll(3000):  # until the events stop
      _, _, payload = sub.recv_multipart()
      for event in msgpack.unpackb(payload)[1]:
        if event[0] == "BlockStored":
          prefix = live[event[2]] if event[2] is not None else []
          for i, key in enumerate(event[1]):
            prefix = prefix + event[3][i * block:(i + 1) * block]
            live[key] = prefix
        elif event[0] == "BlockRemoved":
          for key in event[1]:
            live.pop(key)
        else:
          live.clear()
    sub.close()
  expected = {tuple(p[:block]) for p in prompts} | {tuple(p) for p in prompts}
  assert sorted(map(tuple, live.values())) == sorted(expected)
