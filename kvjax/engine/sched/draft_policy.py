"""How many drafts a speculative step verifies, chosen from measurements (issue 17).

A verify step with k drafts costs t(B, k) seconds for a row group of B rows
(the bucketed batch) and emits, per row r, E_k(r) = 1 + A_1(r) + ... + A_k(r)
tokens, where A_i(r) is the chance that drafts 1..i are all accepted.  The
adaptive policy measures both online and picks, per step,

    k* = argmax_k  sum_r E_k(r) / t(B, k),    k in 0..K_max,

over the candidate k (by default 0 and K_max: each k is a family of step
programs to compile), so speculation is used only where it pays: k = 0 is
plain decoding (the plain step program, no drafting), and a step after it has
no drafts to verify, so it drafts first (its rows verify 0).  A bucket
switches k only for a gain above `switch_margin` (a switch costs a step of
rebuilt drafts), and drafts at all only for that gain over plain decoding:
what drafting costs beyond its decode steps counts against it alone (prompts
run the MTP modules; on a 2-core Xeon at batch 8, k = 2 estimated within 1% of
plain was chosen in 23 of 148 steps, and fixed k = 2 ran 0.83x plain).
Prefill first: when the step's token budget cannot hold the prefill work
waiting to run beside the decode rows, k is capped at `most`, the drafts that
still leave room for it (the engine computes it), since a draft slot would
displace a prefill token that is certain work, and prefilled requests raise
the batch the next steps decode.  Prefill rows draft what the decode group
they join runs now (`prefill_drafts`; the nearest group size's choice until
theirs has chosen, K_max until any has):
where speculation does not pay, a prompt skips the MTP modules too (their K/V
for it is left unwritten; should the group switch to drafts later, the modules
attend stale K/V there, which lowers that request's acceptance, never changes
its tokens).  Estimates:
  * t(B, k): the measured seconds per step of decode-only steps, per (row
    bucket, k): the median of the last `window` reports' seconds per step,
    each weighted by its steps (a burst of U steps weighs U times a single
    step, so a short burst's host overhead, paid once per call, cannot stand
    for the long ones).  A median, not a mean: on shared cores a report can
    run several times slower than the program (a stall; the first real burst
    of a fresh engine), and one such report, say the only k = 0 burst between
    bursts of k = 2, must not flip the choice; a lasting change moves it once
    it fills more than half the window; a step
    that compiled a program is not reported by the engine, a (bucket, k)'s
    first report is not counted either (its first call here), and an
    estimate needs `warmup` more.  The first bucket measures
    every k; a later bucket measures one k (what the nearest bucket would pick)
    and scales it by the cost ratios t(k) / t(0) measured elsewhere, so new
    buckets do not compile K + 1 programs each.  The second-best k is re-tried
    every `explore_every` decisions so a stale estimate cannot lock a choice in.
  * A_i(r): per request, accepted_i / proposed_i (kvjax.engine.metrics.RequestMetrics
    counts them) shrunk toward the engine-wide rate with `prior_weight`
    pseudo-observations; the engine-wide rate starts at `prior_acceptance`^i.
Outputs never depend on k: greedy verification is exact and rejection
sampling keeps the target distribution for any number of drafts, so only
speed does.  `FixedDrafts` is the constant policy (it ignores `most`); a policy
is any object with the same five methods (`choose(bucket, requests, most)`,
`prefill_drafts(bucket)`, `observe_step`, `observe_verify`, `estimates`).

The engine asks the policy through `decode_drafts` (the decode rows' J, before planning:
fewer drafts leave budget to prefill) and `prefill_drafts` (after: what their decode group
runs now); prefill rows of an n-gram engine draft nothing (their drafts come from the host
once they decode, kvjax/engine/sched/ngram.py).  A policy's choice outside 0..J_max is a
ValueError.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Optional, Sequence

__all__ = ["FixedDrafts", "AdaptiveDrafts", "expected_tokens", "policy_from", "decode_drafts",
           "prefill_drafts"]

# An exploration runs a whole step (at batch 1 a 16-step burst) at a k the estimates
# rank worse, so the gap between explorations doubles while the choice holds, up to this
# many times explore_every.
_MAX_EXPLORE_BACKOFF = 16


def expected_tokens(accept_through: Sequence[float], k: int) -> float:
  """1 + A_1 + ... + A_k: a row's expected emitted tokens when it verifies k drafts."""
  return 1.0 + sum(accept_through[:k])


@dataclasses.dataclass
class FixedDrafts:
  """Always num_draft drafts (the engine's behaviour without a policy)."""

  num_draft: int

  def choose(self, bucket: int, requests: Sequence, most: Optional[int] = None) -> int:
    return self.num_draft

  def prefill_drafts(self, bucket: int) -> int:
    return self.num_draft

  def observe_step(self, bucket: int, k: int, seconds: float, num_steps: int) -> None:
    pass

  def observe_verify(self, num_draft: int, num_accepted: int) -> None:
    pass

  def estimates(self) -> dict:
    return {"policy": "fixed", "num_draft": self.num_draft}


class AdaptiveDrafts:
  """Maximize expected emitted tokens per second over k in 0..max_drafts (module doc)."""

  def __init__(self, max_drafts: int, *, prior_acceptance: float = 0.7,
               prior_weight: float = 4.0, window: int = 8, warmup: int = 3,
               explore_every: int = 64, candidates: Optional[Sequence[int]] = None,
               switch_margin: float = 0.05):
    if max_drafts < 1:
      raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
    self.max_drafts = max_drafts
    self.prior_weight = prior_weight
    self.window = window
    self.warmup = warmup
    self.explore_every = explore_every
    # Each k is a step program family (x row and table buckets) to compile: by default
    # only plain decoding and the most drafts.
    self.candidates = tuple(sorted(set(candidates if candidates is not None
                                       else (0, max_drafts))))
    if not set(self.candidates) <= set(range(max_drafts + 1)) or 0 not in self.candidates:
      raise ValueError(f"candidates must be drafts in 0..{max_drafts} including 0 (plain "
                       f"decoding, what every cost is measured against), got {candidates!r}")
    self.switch_margin = switch_margin
    self._current: dict[int, int] = {}  # bucket -> the k it runs now
    self._prior = [prior_acceptance ** (i + 1) for i in range(max_drafts)]
    self._recent: dict[tuple[int, int], deque] = {}  # the last reports' (s per step, steps)
    self._seconds: dict[tuple[int, int], float] = {}  # (bucket, k) -> s per step
    self._count: dict[tuple[int, int], int] = {}  # calls seen, the compiling one included
    self._proposed = [0] * max_drafts  # engine-wide, finished requests included
    self._accepted = [0] * max_drafts
    self._since: dict[int, int] = {}  # bucket -> decisions since it last explored
    self._gap: dict[int, int] = {}  # bucket -> decisions between its explorations
    self.last_choice: Optional[dict] = None

  # -- measurements -------------------------------------------------------------

  def observe_step(self, bucket: int, k: int, seconds: float, num_steps: int) -> None:
    """A decode-only step (or burst of num_steps) of `bucket` rows verified with k drafts."""
    key = (bucket, k)
    self._count[key] = self._count.get(key, 0) + 1
    if self._count[key] == 1:
      return  # its first call here (the engine skips the ones that compiled)
    steps = max(num_steps, 1)
    recent = self._recent.setdefault(key, deque(maxlen=self.window))
    recent.append((seconds / steps, steps))
    self._seconds[key] = _weighted_median(recent)

  def observe_verify(self, num_draft: int, num_accepted: int) -> None:
    """One row's verify outcome (engine-wide acceptance)."""
    for i in range(num_draft):
      self._proposed[i] += 1
      self._accepted[i] += i < num_accepted

  def accept_through(self, metrics=None) -> list[float]:
    """[A_1..A_K] for a request (its RequestMetrics, or None: the engine-wide estimate)."""
    w = self.prior_weight
    overall = [(a + w * p) / (n + w)
               for a, n, p in zip(self._accepted, self._proposed, self._prior)]
    if metrics is None or not metrics.proposed:
      return overall
    return [(a + w * g) / (n + w) for a, n, g in zip(metrics.accepted, metrics.proposed, overall)]

  # -- the decision -------------------------------------------------------------

  def choose(self, bucket: int, requests: Sequence, most: Optional[int] = None) -> int:
    """k for a decode row group of `bucket` rows; `requests`: their RequestMetrics; most:
    the drafts that leave the budget to waiting prefill work (None: no cap)."""
    k = self._choose(bucket, requests)
    if most is not None and k > most:
      k = max(c for c in self.candidates if c <= most)  # 0 is always a candidate
      self.last_choice = dict(self.last_choice, k=k, reason="prefill first")
    return k

  def prefill_drafts(self, bucket: int) -> int:
    """Drafts a prefill row makes for the decode group of `bucket` rows it joins: the k
    that group runs now; for a group size that has not chosen, what the nearest one that
    has runs (a batch filling up passes through buckets 1, 2, 4, ... that never decode);
    the most until any has chosen (measuring k > 0 needs drafts)."""
    if bucket in self._current:
      return self._current[bucket]
    if not self._current:
      return self.candidates[-1]
    # Nearest by ratio (buckets are powers of two); a tie goes to the larger group.
    return self._current[min(self._current,
                             key=lambda b: (abs(math.log2(b / bucket)), -b))]

  def _choose(self, bucket: int, requests: Sequence) -> int:
    ks = self.candidates
    seconds = {k: self._estimate(bucket, k) for k in ks}
    missing = [k for k in ks if seconds[k] is None]
    if missing:
      k = self._first_to_measure(bucket, missing, requests)
      self.last_choice = {"bucket": bucket, "k": k, "reason": "measuring"}
      return k
    rates = self._rates(seconds, requests)
    ranked = sorted(rates, key=rates.get, reverse=True)
    best, current = ranked[0], self._current.get(bucket, ranked[0])
    if rates[best] < rates[current] * (1 + self.switch_margin):
      best = current  # switching costs (drafts to rebuild, programs): only for a clear gain
    if rates[best] < rates[0] * (1 + self.switch_margin):
      best = 0  # drafting costs more than its steps (module doc): only for a clear gain
    if best != self._current.get(bucket, best):
      self._gap[bucket] = self.explore_every  # a new choice is re-checked soon
    self._since[bucket] = self._since.get(bucket, 0) + 1
    explore = len(ranked) > 1 and self._since[bucket] >= self._gap.get(bucket, self.explore_every)
    if explore:  # a choice that keeps holding is re-checked ever more rarely
      self._since[bucket] = 0
      self._gap[bucket] = min(2 * self._gap.get(bucket, self.explore_every),
                              _MAX_EXPLORE_BACKOFF * self.explore_every)
    k = next(j for j in ranked if j != best) if explore else best
    self._current[bucket] = best
    self.last_choice = {"bucket": bucket, "k": k, "tokens_per_s": rates,
                        "reason": "exploring" if explore else "best"}
    return k

  def _rates(self, seconds: dict, requests: Sequence) -> dict:
    through = [self.accept_through(m) for m in requests]
    return {k: sum(expected_tokens(a, k) for a in through) / s for k, s in seconds.items()}

  def _measured(self, bucket: int, k: int) -> bool:
    return self._count.get((bucket, k), 0) >= self.warmup + 1

  def _ratios(self) -> dict:
    """k -> t(B, k) / t(B, 0), averaged over the buckets that measured both."""
    ratios = {}
    for k in self.candidates:
      pairs = [self._seconds[(b, k)] / self._seconds[(b, 0)] for b, j in self._seconds
               if j == 0 and self._measured(b, 0) and self._measured(b, k)]
      if pairs:
        ratios[k] = sum(pairs) / len(pairs)
    return ratios

  def _estimate(self, bucket: int, k: int) -> Optional[float]:
    """Measured t(bucket, k), else one measured k of this bucket times the cost ratios
    other buckets measured (so a new bucket needs one program measured, not K + 1)."""
    if self._measured(bucket, k):
      return self._seconds[(bucket, k)]
    ratios = self._ratios()
    base = [self._seconds[(bucket, j)] / ratios[j] for j in ratios if self._measured(bucket, j)]
    return sum(base) / len(base) * ratios[k] if base and k in ratios else None

  def _first_to_measure(self, bucket: int, missing: list, requests: Sequence) -> int:
    """Which unmeasured k to run: what the nearest measured bucket would choose, if any."""
    others = sorted({b for b, k in self._seconds if b != bucket and
                     all(self._estimate(b, j) is not None for j in self.candidates)},
                    key=lambda b: abs(b - bucket))
    if not others:
      return missing[0]
    rates = self._rates({k: self._estimate(others[0], k) for k in missing}, requests)
    return max(rates, key=rates.get)

  def estimates(self) -> dict:
    """What the policy believes: step seconds per (bucket, k) and acceptance A_i."""
    return {"policy": "adaptive", "max_drafts": self.max_drafts,
            "step_s": {f"{b}x{k}": s for (b, k), s in sorted(self._seconds.items())},
            "accept_through": self.accept_through(), "last_choice": self.last_choice}


def _weighted_median(samples) -> float:
  """The smallest value with at least half the total weight at or below it, of
  (value, weight) samples (at least one)."""
  ordered = sorted(samples)
  half, seen = sum(w for _, w in ordered) / 2, 0.0
  for value, weight in ordered:
    seen += weight
    if seen >= half:
      break
  return value


def policy_from(spec, max_drafts: int):
  """EngineConfig.draft_policy -> a policy object (None: fixed; 'adaptive'; an object)."""
  if spec is None:
    return FixedDrafts(max_drafts)
  if spec == "adaptive":
    return AdaptiveDrafts(max_drafts)
  methods = ("choose", "prefill_drafts", "observe_step", "observe_verify", "estimates")
  if isinstance(spec, str) or not all(hasattr(spec, m) for m in methods):
    raise ValueError(f"draft_policy must be None, 'adaptive' or an object with "
                     f"{', '.join(methods)}, got {spec!r}")
  return spec


# -- the engine's side: each step's row groups ask the policy -------------------------

def decode_drafts(policy, scheduler, packing, metrics: dict, num_draft: int) -> int:
  """J of this step's decode rows: the draft policy's choice for the running requests
  that decode (their row bucket and RequestMetrics); num_draft without a policy."""
  decoding = [r for r in scheduler.running if r.is_decoding]
  if policy is None or not decoding:
    return num_draft
  bucket = packing.decode_rows_bucket(len(decoding))
  return _checked(policy.choose(bucket, [metrics[r.request_id] for r in decoding],
                                _drafts_beside_prefill(scheduler, len(decoding))), num_draft)


def prefill_drafts(policy, scheduler, packing, num_draft: int, host_drafts: bool) -> int:
  """J of this step's prefill rows: the policy's for the group of every running request
  (0 with host drafts)."""
  if host_drafts:
    return 0
  if policy is None:
    return num_draft
  bucket = packing.decode_rows_bucket(len(scheduler.running))
  return _checked(policy.prefill_drafts(bucket), num_draft, "prefill ")


def _checked(k: int, num_draft: int, rows: str = "") -> int:  # a policy object's choice
  if not 0 <= k <= num_draft:
    raise ValueError(f"draft policy chose {k} {rows}drafts; it may choose 0..{num_draft}")
  return k


def _drafts_beside_prefill(s, num_decoding: int) -> Optional[int]:
  """The most drafts per decode row that leave this step's budget to every prefill
  token that could run in it (running prompts' rest, prompts a free slot of scheduler
  s could admit); None when no prefill work waits."""
  pending = sum(r.num_tokens - r.num_computed_tokens for r in s.running if not r.is_decoding)
  admittable = list(s.waiting)[:max(0, s.max_num_seqs - len(s.running))]
  pending += sum(r.num_tokens for r in admittable)
  if not pending:
    return None
  return max(0, (s.max_num_batched_tokens - pending) // num_decoding - 1)
