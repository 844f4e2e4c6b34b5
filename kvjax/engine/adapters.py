"""An engine's LoRA adapters: loaded into device slots at run time, picked per request.

With EngineConfig.max_loras > 0 the model's projections carry max_loras + 1 adapter slots
(kvjax/lora/; slot 0 is the base model), so loading or unloading an adapter writes a slot
and recompiles nothing.  A request's prefix blocks are salted with its adapter's name and
load (the prefix cache keys), so two adapters, or an adapter and the base model, never
share pages, and an adapter reloaded under the same name never reads its predecessor's;
unloading forgets the adapter's cached blocks.  `Adapters` is the Engine's collaborator
(kvjax/engine/engine.py load_adapter / unload_adapter / add_request(lora=...)): it takes
and returns the engine's model, whose params hold the slots.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

from kvjax.engine.sched.prefix_cache import root_hash
from kvjax.engine.validation import check_lora
from kvjax.lora.peft import read_adapter, set_slot, with_slots

__all__ = ["Adapters", "LoadedAdapter"]


@dataclasses.dataclass
class LoadedAdapter:
  slot: int  # its slot in the model's adapter tables (1..max_loras)
  path: str
  load: int  # which load of the engine this is (part of its requests' cache salts)
  salts: set = dataclasses.field(default_factory=set)  # its requests' prefix-cache salts


class Adapters:
  """The loaded adapters by name (`loaded`), their slots, loads and cache salts."""

  def __init__(self, max_loras: int, max_rank: int):
    self.max_loras, self.max_rank = max_loras, max_rank
    self.loaded: dict[str, LoadedAdapter] = {}
    self._loads = itertools.count(1)

  def slotted(self, model):
    """`model` with max_loras + 1 zero adapter slots (itself without adapters)."""
    if not self.max_loras:
      return model
    params = with_slots(model.params, model.config, self.max_loras + 1, self.max_rank)
    return dataclasses.replace(model, params=params)

  def load(self, model, name: str, path: str):
    """`model` with the PEFT LoRA adapter in directory `path` loaded as `name`
    (kvjax/lora/peft.py); ValueError (nothing changed) on a taken name, no free slot or a
    bad adapter."""
    if not isinstance(name, str) or not name:
      raise ValueError(f"lora_name must be a non-empty string, got {name!r:.200}")
    if name in self.loaded:
      raise ValueError(f"lora_name {name!r} is already loaded (unload it first)")
    if not isinstance(path, str):
      raise ValueError(f"lora_path must be a string, got {path!r:.200}")
    if not self.max_loras:
      raise ValueError("this engine has no LoRA adapter slots (EngineConfig.max_loras=0; "
                       "kvjax serve --max-loras N)")
    taken = {a.slot for a in self.loaded.values()}
    free = [s for s in range(1, self.max_loras + 1) if s not in taken]
    if not free:
      raise ValueError(f"lora_name {name!r}: all max_loras={self.max_loras} adapter slots "
                       f"are taken ({sorted(self.loaded)}); unload one first")
    try:
      adapter = read_adapter(path, model.config, model.params)
    except (OSError, ValueError) as error:
      raise ValueError(f"lora_path {path!r}: {error}") from None
    if adapter.rank > self.max_rank:
      raise ValueError(f"lora_path {path!r}: rank {adapter.rank} exceeds the engine's "
                       f"max_lora_rank={self.max_rank}")
    model = dataclasses.replace(model, params=set_slot(model.params, free[0], adapter))
    self.loaded[name] = LoadedAdapter(free[0], path, next(self._loads))
    return model

  def unload(self, model, name: str, scheduler):
    """`model` without adapter `name`: its slot zeroed and freed, its cached prefix blocks
    forgotten; ValueError (nothing changed) if it is not loaded or a request uses it."""
    check_lora(name, self.loaded)
    loaded = self.loaded[name]
    users = sorted(r.request_id for r in scheduler.requests.values()
                   if r.lora_slot == loaded.slot)
    if users:
      raise ValueError(f"lora {name!r} is in use by requests {users}")
    model = dataclasses.replace(model, params=set_slot(model.params, loaded.slot, None))
    for cache in scheduler.groups.prefix_caches:  # every KV layer group's
      for salt in loaded.salts:
        cache.discard_tree(root_hash(salt))
    del self.loaded[name]
    return model

  def request(self, lora, cache_salt: Optional[str]):
    """A request's (adapter slot, prefix-cache salt): the salt names the adapter's load
    too, a tuple, so it never equals a string salt (kvjax/engine/sched/prefix_cache.py
    hashes its repr)."""
    name = check_lora(lora, self.loaded)
    if name is None:
      return 0, cache_salt
    loaded = self.loaded[name]
    salt = ("lora", name, loaded.load, cache_salt)
    loaded.salts.add(salt)
    return loaded.slot, salt
