"""Fixed engine and static-batch runs whose tokens were recorded before the
issue-11 refactor (tests/data/golden_tokens.json); tests/test_golden.py
replays them and requires bit-identical tokens: seeded sampled engine runs
(what no oracle pins down token by token), greedy and sampled kvjax.generate.
`python -m tests.golden_runs` re-records (only ever from a commit known to be right)."""
from __future__ import annotations

import json
import os

import jax

import kvjax
from kvjax.model.params import init_params
from tests import engine_helpers as eh

PATH = os.path.join(os.path.dirname(__file__), "data", "golden_tokens.json")
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9)


def _draft_model() -> kvjax.Model:
  cfg = kvjax.get_preset("tiny").replace(name="tiny-draft", num_layers=1, eos_token_id=None,
                                         mtp_num_hidden_layers=0)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(7), std=0.2))


def _engine_runs(name, **engine_kwargs):
  """The seeded sampled run of one engine case.  Its greedy run is not replayed: every
  case's greedy tokens are checked against an independent oracle elsewhere (plain
  greedy decoding, the static batch), which a replay would only repeat."""
  tokens = eh.run_staggered(eh.engine(**engine_kwargs), eh.prompts(6, seed=3, shared=9),
                            seed=11, **SAMPLED)
  return {f"{name}/sampled": [tokens[i] for i in range(len(tokens))]}


CASES = {
    "plain": dict(),
    "mtp": dict(speculative="mtp", num_draft=2),
    "mtp_token_prefix": dict(speculative="mtp", num_draft=2, prefix_match="token"),
    "int8": dict(kv_dtype="int8"),
    "tiny_pool": dict(num_pages=eh.TINY_POOL + 2),
}


def record() -> dict:
  out = {}
  for name, kwargs in CASES.items():
    out.update(_engine_runs(name, **kwargs))
  out.update(_engine_runs("draft_model", speculative=_draft_model(), num_draft=2))
  model = eh.mtp_model()
  prompts = eh.prompts(3, seed=5)
  for cache in ("paged", "contiguous", "none"):
    out[f"generate/{cache}/greedy"] = kvjax.generate(model, prompts, 8, cache=cache).tokens
    out[f"generate/{cache}/sampled"] = kvjax.generate(model, prompts, 8, cache=cache, seed=4,
                                                      **SAMPLED).tokens
  return out


if __name__ == "__main__":
  tokens = record()
  with open(PATH, "w") as f:
    json.dump(tokens, f, indent=0, sort_keys=True)
  print(f"recorded {len(tokens)} runs to {PATH}")
