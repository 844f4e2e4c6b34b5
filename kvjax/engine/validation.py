"""One validation of a request's sampling parameters, shared by kvjax.generate and
Engine.add_request: exact types (a bool is not an int, an integral float is not an
int), ranges that fit the device dtypes, finite floats.  Every error is a ValueError
naming the field and the value, raised before anything touches the scheduler."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Collection, Optional, Sequence, Union

import numpy as np

from kvjax.engine.requests import SamplingOptions
from kvjax.runtime.sampling import MAX_LOGPROBS

__all__ = ["prompt_ids", "check_int", "sampling_options", "stop_ids", "per_prompt_seeds",
           "SEED_RANGE", "EXTENSIONS", "check_arrival", "check_cache_salt", "check_lora",
           "check_request_id", "CheckedRequest", "checked_request"]

SEED_RANGE = (0, 2**32)  # a seed becomes a uint32 PRNG key on the device
# vLLM's request extensions sampling_options takes (kvjax/engine/requests.py SamplingOptions).
EXTENSIONS = ("ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "logit_bias", "min_p")
# A logit divided or multiplied by a penalty in this range stays finite in float32 for any
# logit a model writes (far below 1e30); vLLM allows any positive value.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def prompt_ids(prompt, vocab_size: int) -> np.ndarray:
  """prompt as a 1-D int array of ids inside the vocabulary; ValueError naming it."""
  try:
    ids = np.asarray(prompt)
  except (ValueError, TypeError, OverflowError) as error:  # ragged or odd sequences
    raise ValueError(f"prompt must be a non-empty 1-D list of int token ids: {error}") \
        from None
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"prompt must be a non-empty 1-D list of int token ids, got shape "
                     f"{ids.shape} dtype {ids.dtype}")
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise ValueError(f"prompt token id {int(bad[0])} outside [0, vocab_size={vocab_size})")
  return ids


def check_int(name: str, value, low: int, high: Optional[int] = None) -> int:
  """value as an int in [low, high) (high None: no bound); ValueError naming `name`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
  if value < low or (high is not None and value >= high):
    if high is None:
      kind = "a positive int" if low == 1 else f"an int >= {low}"
      raise ValueError(f"{name} must be {kind}, got {value!r}")
    raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")
  return int(value)


def _check_real(name: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value!r}")
  return float(value)


def sampling_options(vocab_size: int, *, temperature=0.0, top_k=None, top_p=None,
                     seed=None, logprobs=None, max_tokens=None, prompt_logprobs=None,
                     **extensions) -> SamplingOptions:
  """Validated SamplingOptions (top_k None/0: off; top_p None: 1; seed None: 0;
  logprobs None: off, n: each token's log p and its n likeliest alternatives;
  prompt_logprobs the same for each prompt position after the first).

  extensions: vLLM's fields (kvjax/engine/requests.py SamplingOptions; None: the default):
  ignore_eos, min_tokens (<= max_tokens when given), repetition_penalty (> 0),
  presence_penalty and frequency_penalty (in [-2, 2]), logit_bias ({token id or its
  decimal string: bias in [-100, 100]}), min_p (in [0, 1]).
  Floats must survive the device's float32: temperature <= float32's largest (beyond, it
  rounds to inf, and a masked logit's -inf / inf is NaN); repetition_penalty in
  REPETITION_PENALTY_RANGE (1e300 rounds to inf and 1e-300 to 0, whose quotient is inf).
  """
  unknown = sorted(set(extensions) - set(EXTENSIONS))
  if unknown:
    raise ValueError(f"unknown request option(s) {unknown}; kvjax takes {list(EXTENSIONS)}")
  temperature = _check_real("temperature", temperature)
  if not 0 <= temperature <= _FLOAT32_MAX:
    raise ValueError(f"temperature must be in [0, {_FLOAT32_MAX:.8g}] (0 = greedy; the "
                     f"upper bound: float32's largest), got {temperature!r}")
  top_k = 0 if top_k is None else check_int("top_k", top_k, 0, vocab_size + 1)
  top_p = 1.0 if top_p is None else _check_real("top_p", top_p)
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
  seed = 0 if seed is None else check_int("seed", seed, *SEED_RANGE)
  most = min(MAX_LOGPROBS, vocab_size) + 1
  logprobs = None if logprobs is None else check_int("logprobs", logprobs, 0, most)
  if prompt_logprobs is not None:
    prompt_logprobs = check_int("prompt_logprobs", prompt_logprobs, 0, most)
  return SamplingOptions(temperature, top_k, top_p, seed, logprobs,
                         prompt_logprobs=prompt_logprobs,
                         **_extensions(vocab_size, max_tokens, **extensions))


def _extensions(vocab_size: int, max_tokens, *, ignore_eos=None, min_tokens=None,
                repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
                logit_bias=None, min_p=None) -> dict:
  """vLLM's request extensions, checked -> SamplingOptions keywords."""
  out = {}
  if ignore_eos is not None:
    if not isinstance(ignore_eos, bool):
      raise ValueError(f"ignore_eos must be a boolean, got {ignore_eos!r}")
    out["ignore_eos"] = ignore_eos
  if min_tokens is not None:
    out["min_tokens"] = check_int("min_tokens", min_tokens, 0)
    if max_tokens is not None and out["min_tokens"] > max_tokens:
      raise ValueError(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
  if repetition_penalty is not None:
    out["repetition_penalty"] = _check_real("repetition_penalty", repetition_penalty)
    low, high = REPETITION_PENALTY_RANGE
    if not low <= out["repetition_penalty"] <= high:
      raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off; a "
                       f"float32-safe range), got {repetition_penalty!r}")
  if min_p is not None:
    out["min_p"] = _check_real("min_p", min_p)
    if not 0 <= out["min_p"] <= 1:
      raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")
  for name, value in (("presence_penalty", presence_penalty),
                      ("frequency_penalty", frequency_penalty)):
    if value is not None:
      out[name] = _check_real(name, value)
      if not -2 <= out[name] <= 2:
        raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
  if logit_bias is not None:
    out["logit_bias"] = _logit_bias(logit_bias, vocab_size)
  return out


def _logit_bias(logit_bias, vocab_size: int) -> tuple:
  """{token id or its decimal string: bias in [-100, 100]} -> sorted ((id, bias), ...)."""
  if not isinstance(logit_bias, dict):
    raise ValueError(f"logit_bias must be an object of token id: bias, got {logit_bias!r:.200}")
  pairs = []
  for key, bias in logit_bias.items():
    token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
    token = check_int("logit_bias token id", token, 0, vocab_size)
    bias = _check_real(f"logit_bias[{key!r}]", bias)
    if not -100 <= bias <= 100:
      raise ValueError(f"logit_bias[{key!r}] must be in [-100, 100], got {bias!r}")
    pairs.append((token, bias))
  return tuple(sorted(pairs))


def stop_ids(stop: Union[None, int, Sequence[int]], vocab_size: int) -> tuple:
  """stop: None, one id or a list of ids, each in [0, vocab_size) -> tuple of ints."""
  if stop is None:
    return ()
  if isinstance(stop, (str, bytes)) or not isinstance(stop, (numbers.Integral, Sequence)):
    raise ValueError(f"stop must be a token id or a list of token ids, got {stop!r}")
  ids = (stop,) if isinstance(stop, numbers.Integral) else tuple(stop)
  return tuple(check_int("stop", s, 0, vocab_size) for s in ids)


def check_arrival(arrival_s) -> Optional[float]:
  """arrival_s: None (now) or a finite time.perf_counter reading -> float or None."""
  return None if arrival_s is None else _check_real("arrival_s", arrival_s)


def check_cache_salt(cache_salt) -> Optional[str]:
  """cache_salt: None or a string (it enters the prefix blocks' hashes)."""
  if cache_salt is not None and not isinstance(cache_salt, str):
    raise ValueError(f"cache_salt must be a string, got {cache_salt!r:.200} "
                     f"({type(cache_salt).__name__})")
  return cache_salt


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
  """Engine.add_request's arguments, checked."""
  ids: np.ndarray  # [prompt length] int32
  max_new_tokens: int
  sampling: SamplingOptions
  stop_ids: tuple
  cache_salt: Optional[str]
  arrival_s: Optional[float]


def checked_request(vocab_size: int, prompt, max_new_tokens, *, speculative: Optional[str],
                    stop=None, cache_salt=None, arrival_s=None, **sampling) -> CheckedRequest:
  """Engine.add_request's arguments in its order (the first bad one is named);
  speculative: the engine's drafting (None: none), which min_tokens, penalties and
  logit_bias cannot ride (drafts are verified unprocessed)."""
  ids = prompt_ids(prompt, vocab_size)
  max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
  options = sampling_options(vocab_size, max_tokens=max_new_tokens, **sampling)
  request = CheckedRequest(ids, max_new_tokens, options, stop_ids(stop, vocab_size),
                           check_cache_salt(cache_salt), check_arrival(arrival_s))
  if options.processed and speculative:
    raise ValueError("min_tokens, penalties and logit_bias need an engine without "
                     f"speculative decoding (this one: {speculative})")
  return request


def check_lora(lora, loaded: Collection[str]) -> Optional[str]:
  """lora: None (the base model) or the name of a loaded LoRA adapter."""
  if lora is None:
    return None
  if not isinstance(lora, str):
    raise ValueError(f"lora must be a string naming a loaded adapter, got {lora!r:.200} "
                     f"({type(lora).__name__})")
  if lora not in loaded:
    raise ValueError(f"lora {lora!r:.200} is not a loaded adapter; loaded: {sorted(loaded)}")
  return lora


def check_request_id(request_id) -> str:
  """A request id as add_request returns it: a string."""
  if not isinstance(request_id, str):
    raise ValueError(f"request_id must be a string (as add_request returns), got "
                     f"{request_id!r:.200} ({type(request_id).__name__})")
  return request_id


def per_prompt_seeds(seed: Union[int, Sequence[int]], num_prompts: int) -> list:
  """One seed for every prompt, or one per prompt -> a list of num_prompts seeds."""
  seeds = [seed] * num_prompts if isinstance(seed, numbers.Integral) else list(seed)
  if len(seeds) != num_prompts:
    raise ValueError(f"got {len(seeds)} seeds for {num_prompts} prompts")
  return seeds
