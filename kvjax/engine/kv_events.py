"""vLLM-format KV events from an engine's prefix cache, published over ZMQ (serve --kv-events).

A KV-aware router (llm-d's precise prefix scorer, NVIDIA Dynamo's KV router) learns
which blocks each worker caches from these events, as vLLM publishes them
(vllm/distributed/kv_events.py, msgspec structs encoded `array_like`):

  frames   (topic, sequence number: 8 bytes big-endian from 0, msgpack payload)
  payload  [ts, [event, ...], data_parallel_rank]   one batch per flush
  event    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
            lora_id, medium, lora_name]
           ["BlockRemoved", block_hashes, medium]
           ["AllBlocksCleared"]

Block hashes are kvjax's sha256 block hashes (kvjax/engine/sched/prefix_cache.py) cut to their last
8 bytes as an unsigned 64-bit integer, as vLLM sends by default.  parent_block_hash is
None for a request's first block, and also when the parent block is no longer cached
(the cache evicts tail blocks first, so that is rare).  Consecutive stores chain into
one BlockStored (its blocks' tokens concatenated); medium is "GPU", vLLM's name for the
accelerator's memory, the tier every kvjax block lives in.  A publisher starts with
AllBlocksCleared: a subscriber that knew an earlier process forgets its blocks.

The engine thread only appends to a list (`stored` / `removed`, the PrefixCache's
listener); a daemon thread flushes it every `flush_s` and owns the socket.  An endpoint
with `*` (tcp://*:5557) or an ipc:// one is bound, others connected (vLLM's rule).
Needs pyzmq and msgpack (`pip install kvjax[kv-events]`).
"""
from __future__ import annotations

import threading
import time
from typing import Optional

__all__ = ["KVEventPublisher", "external_hash", "replica_endpoint", "MEDIUM"]

MEDIUM = "GPU"


def external_hash(block_hash: bytes) -> int:
  """A kvjax block hash as the 64-bit integer vLLM publishes."""
  return int.from_bytes(block_hash[-8:], "big")


def replica_endpoint(endpoint: str, rank: int) -> str:
  """Replica `rank`'s endpoint: a tcp:// port + rank, an ipc:// or inproc:// path + _dp<rank>
  (vLLM's rule for data-parallel ranks)."""
  if rank == 0:
    return endpoint
  if endpoint.startswith("tcp://"):
    base, port = endpoint.rsplit(":", 1)
    return f"{base}:{int(port) + rank}"
  return f"{endpoint}_dp{rank}"


class KVEventPublisher:
  """Publishes one PrefixCache's block events to `endpoint`; `attach(cache)` listens."""

  def __init__(self, endpoint: str, block_size: int, *, topic: str = "",
               data_parallel_rank: int = 0, flush_s: float = 0.01):
    try:
      import msgpack
      import zmq
    except ImportError as error:
      raise ImportError("--kv-events needs pyzmq and msgpack: pip install pyzmq msgpack"
                        ) from error
    self._pack = msgpack.Packer(use_bin_type=True).pack
    self.block_size, self._topic, self._rank = block_size, topic.encode(), data_parallel_rank
    self._socket = zmq.Context.instance().socket(zmq.PUB)
    self._socket.setsockopt(zmq.LINGER, 1000)
    bind = "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    (self._socket.bind if bind else self._socket.connect)(endpoint)
    self._lock = threading.Lock()
    self._pending: list = [["AllBlocksCleared"]]
    self._cached: set[int] = set()  # what a subscriber knows is cached (parents)
    self._seq = 0
    self._flush_s = flush_s
    self._stopping = threading.Event()
    self._thread = threading.Thread(target=self._run, name="kvjax-kv-events", daemon=True)
    self._thread.start()

  def attach(self, prefix_cache) -> "KVEventPublisher":
    prefix_cache.add_block_listener(self.stored, self.removed)
    return self

  # -- the engine thread (PrefixCache listener) -----------------------------------

  def stored(self, block_hash: bytes, parent: bytes, token_ids: tuple) -> None:
    key, parent_key = external_hash(block_hash), external_hash(parent)
    with self._lock:
      last = self._pending[-1] if self._pending else None
      if last is not None and last[0] == "BlockStored" and last[1][-1] == parent_key:
        last[1].append(key)  # the chain goes on: one event
        last[3].extend(token_ids)
      else:
        self._pending.append(["BlockStored", [key],
                              parent_key if parent_key in self._cached else None,
                              list(token_ids), self.block_size, None, MEDIUM, None])
      self._cached.add(key)

  def removed(self, block_hash: bytes) -> None:
    key = external_hash(block_hash)
    with self._lock:
      last = self._pending[-1] if self._pending else None
      if last is not None and last[0] == "BlockRemoved":
        last[1].append(key)
      else:
        self._pending.append(["BlockRemoved", [key], MEDIUM])
      self._cached.discard(key)

  # -- the publisher thread ---------------------------------------------------------

  def _flush(self) -> Optional[int]:
    """Send what is pending as one batch -> its sequence number (None: nothing)."""
    with self._lock:
      events, self._pending = self._pending, []
    if not events:
      return None
    seq, self._seq = self._seq, self._seq + 1
    payload = self._pack([time.time(), events, self._rank])
    self._socket.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
    return seq

  def close(self) -> None:
    """Flush what is pending, then close the socket."""
    self._stopping.set()
    self._thread.join()
    self._socket.close()

  def _run(self) -> None:
    while not self._stopping.wait(self._flush_s):
      self._flush()
    self._flush()
