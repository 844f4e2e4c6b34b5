"""Constrained decoding over HF tokenizers (kvjax/constraints/vocabulary.py): multi-byte
BPE tokens, byte-level and SentencePiece byte-fallback vocabularies alike; every output,
decoded by the tokenizer, validates against its schema (`jsonschema`)."""
from __future__ import annotations

import json

import jax
import jsonschema
import pytest
import transformers

import kvjax
from kvjax.constraints import Constraint
from kvjax.constraints.vocabulary import constraint_book
from kvjax.engine.generate import run_until_finished
from kvjax.model.params import init_params
from kvjax.text.hf_tokenizer import load_tokenizer
from tests.test_constraints import SCHEMAS, SHAPES
from tests.test_hf_tokenizer import _train_byte_level_bpe, _train_sentencepiece_style


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
  train = _train_byte_level_bpe if request.param == "byte_level" else _train_sentencepiece_style
  path = str(tmp_path_factory.mktemp(request.param))
  transformers.PreTrainedTokenizerFast(tokenizer_object=train(), bos_token="<s>",
                                       eos_token="</s>").save_pretrained(path)
  return load_tokenizer(path)


def test_outputs_over_hf_vocabularies_validate(tokenizer):
  assert tokenizer.vocab_size < 640  # the model's padded rows stay masked
  cfg = kvjax.get_preset("tiny").replace(name="tiny-hf-vocab", vocab_size=640,
                                         eos_token_id=tokenizer.eos_ids[0])
  model = kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(4), std=0.2))
  eng = kvjax.Engine(model, **SHAPES, num_scheduler_steps=1)
  eng.constraints = constraint_book(tokenizer, cfg)
  schemas = SCHEMAS[:3]
  ids = [eng.add_request(tokenizer.encode(f"item {i}:"), 120, temperature=1.0, seed=i,
                         constraint=Constraint("json_schema", s)) for i, s in enumerate(schemas)]
  done, _ = run_until_finished(eng.step, ids)
  for rid, schema in zip(ids, schemas):
    out = done[rid]
    assert out.finish_reason == "stop" and out.output_ids[-1] == cfg.eos_token_id
    jsonschema.validate(json.loads(tokenizer.decode(out.output_ids[:-1])), schema)


def test_a_tokenizer_without_the_models_eos_is_refused(tokenizer):
  cfg = kvjax.get_preset("tiny").replace(eos_token_id=None)
  with pytest.raises(ValueError, match="eos_token_id"):
    constraint_book(tokenizer, cfg)
