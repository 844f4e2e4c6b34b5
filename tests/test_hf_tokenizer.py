"""HF tokenizer parity: kvjax.text.hf_tokenizer against transformers' own AutoTokenizer.

Tokenizers are trained offline with the `tokenizers` package, wrapped in transformers'
PreTrainedTokenizerFast and written with save_pretrained; transformers then loads each
directory as the oracle for encode, decode, chat templates and streaming text.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import hypothesis
import jinja2
import pytest
import transformers
from hypothesis import strategies as st
from tokenizers import (Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

from kvjax.text.chat_template import render_chat_template
from kvjax.text.hf_tokenizer import HFTokenizer, load_tokenizer
from kvjax.text.tokenizer import Tokenizer as TokenizerInterface


SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ("The quick brown fox jumps over the lazy dog. Hello, world! don't we're I'm "
          "def main():\n    return 0\n" * 8
          + "日本語のテキストです。你好，世界！한국어 café naïve Ω≈ç√ 🐍🚀😀 emoji\n\t  x " * 6)

TEXTS = {
    "ascii": "Hello world! The fox.",
    "empty": "",
    "cjk": "日本語のテキスト。你好，世界！한국어",
    "emoji": "emoji 🐍🚀😀 and a family 👩‍👩‍👧 flag 🇯🇵",
    "space_runs": "  leading and   runs of    spaces   ",
    "newlines_tabs": "tabs\tand\nnewlines\n\n\r\n  indented\n",
    "special_text": "<s>special</s> text <|im_start|>user\nhi<|im_end|>\n",
    "accents": "café naïve Ω≈ç√ Zürich",
    "cleanup_bait": "don't , you ' re . ok ? yes ! we 've I 'm",
    "config_only_special": "a [MASK] b",
}

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA3 = ("{{ bos_token }}{% for message in messages %}"
          "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('Unsupported role: ' + message['role']) }}{% endif %}"
          "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")

MESSAGES = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "日本語で 🐍?"}],
    "multi_turn": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello "},
                   {"role": "user", "content": "again\n\nwith  spaces"}],
    "none_field": [{"role": "user", "content": "x", "name": None}],
}


def _train_byte_level_bpe() -> Tokenizer:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
      vocab_size=420, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def _train_wordpiece() -> Tokenizer:
  tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.decoder = decoders.WordPiece(cleanup=False)  # transformers' own cleanup does it
  tok.train_from_iterator([CORPUS], trainers.WordPieceTrainer(
      vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False))
  return tok


def _train_sentencepiece_style() -> Tokenizer:
  """Llama-2's layout: "▁" for spaces, byte-fallback tokens <0x00>..<0xFF> for characters
  outside the (ASCII-only) vocabulary, and a decoder that fuses and strips one space."""
  tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tok.train_from_iterator([CORPUS.encode("ascii", "ignore").decode()], trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
  spec = json.loads(tok.to_str())
  vocab = spec["model"]["vocab"]
  for byte in range(256):
    vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
  spec["model"]["byte_fallback"] = True
  tok = Tokenizer.from_str(json.dumps(spec))
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
      ("<s>", tok.token_to_id("<s>"))])
  return tok


def _edit_json(path, **changes):
  data = {}
  if os.path.exists(path):
    with open(path) as f:
      data = json.load(f)
  with open(path, "w") as f:
    json.dump({**data, **changes}, f)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  """name -> checkpoint directory; each exercises one way configs are written."""
  bpe = _train_byte_level_bpe()
  out = {}
  # ChatML: save_pretrained's own layout (chat_template.jinja, BOS in the post-processor),
  # a list eos_token_id in generation_config.json.
  out["chatml"] = str(tmp_path_factory.mktemp("chatml"))
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="</s>",
      add_bos_token=True, chat_template=CHATML).save_pretrained(out["chatml"])
  _edit_json(os.path.join(out["chatml"], "generation_config.json"),
             eos_token_id=[bpe.token_to_id("</s>"), bpe.token_to_id("<|im_end|>")])
  # Llama-3 style: the template inline in tokenizer_config.json, add_bos_token there (which
  # transformers v5 ignores beside a tokenizer.json), cleanup requested (ignored for BPE),
  # an int eos_token_id in config.json.
  out["llama3"] = str(tmp_path_factory.mktemp("llama3"))
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=bpe, bos_token="<s>", eos_token="<|eot_id|>").save_pretrained(out["llama3"])
  _edit_json(os.path.join(out["llama3"], "tokenizer_config.json"), chat_template=LLAMA3,
             add_bos_token=True, clean_up_tokenization_spaces=True)
  _edit_json(os.path.join(out["llama3"], "config.json"), eos_token_id=bpe.token_to_id("<|eot_id|>"))
  # WordPiece with clean_up_tokenization_spaces (applied to non-BPE models), no template,
  # stop id only from the eos token.
  out["wordpiece"] = str(tmp_path_factory.mktemp("wordpiece"))
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=_train_wordpiece(), unk_token="[UNK]", bos_token="[CLS]",
      eos_token="[SEP]", clean_up_tokenization_spaces=True).save_pretrained(out["wordpiece"])
  # A special token only the config names: transformers adds it to the vocabulary.
  _edit_json(os.path.join(out["wordpiece"], "tokenizer_config.json"), mask_token="[MASK]")
  # SentencePiece style (Llama-2, Mistral): byte fallback and a space-stripping decoder.
  out["sentencepiece"] = str(tmp_path_factory.mktemp("sentencepiece"))
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=_train_sentencepiece_style(), unk_token="<unk>", bos_token="<s>",
      eos_token="</s>").save_pretrained(out["sentencepiece"])
  return out


@pytest.fixture(scope="module")
def pairs(dirs):
  """name -> (kvjax tokenizer, transformers tokenizer) of the same directory."""
  return {name: (load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d))
          for name, d in dirs.items()}


@pytest.mark.parametrize("name", ["chatml", "llama3", "wordpiece", "sentencepiece"])
def test_encode_and_decode_equal_transformers(pairs, name):
  ours, hf = pairs[name]
  for label, text in TEXTS.items():
    assert ours.encode(text) == hf.encode(text), label  # both default add_special_tokens
    for add in (True, False):
      ids = hf.encode(text, add_special_tokens=add)
      assert ours.encode(text, add_special_tokens=add) == ids, (label, add)
      for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip), (label, add, skip)


def test_configs_take_effect(pairs):
  """Each directory's config changed something, so the parity above covers it."""
  chatml, hf_chatml = pairs["chatml"]
  llama3, hf_llama3 = pairs["llama3"]
  wordpiece, hf_wordpiece = pairs["wordpiece"]
  assert chatml.encode("hi")[0] == chatml.bos_id == hf_chatml.bos_token_id  # post-processor BOS
  assert llama3.bos_id not in llama3.encode("hi")  # tokenizer.json's post-processor decides
  ids = hf_wordpiece.encode("don't , ok .", add_special_tokens=False)
  assert wordpiece.decode(ids) == hf_wordpiece.decode(ids) == "don't, ok."  # cleanup applied
  sentencepiece, hf_sentencepiece = pairs["sentencepiece"]
  assert hf_sentencepiece.convert_ids_to_tokens(sentencepiece.encode("日", False)) == [
      "▁", "<0xE6>", "<0x97>", "<0xA5>"]  # byte fallback
  # An encoded special-token text is its one special id, skipped in decode by default.
  im_start = hf_chatml.convert_tokens_to_ids("<|im_start|>")
  assert im_start in chatml.encode(TEXTS["special_text"])
  assert "<|im_start|>" not in chatml.decode(chatml.encode(TEXTS["special_text"]))


@pytest.mark.parametrize("name", ["chatml", "llama3", "wordpiece", "sentencepiece"])
def test_ids_and_vocab_equal_transformers(pairs, name):
  ours, hf = pairs[name]
  assert isinstance(ours, TokenizerInterface)
  assert ours.vocab_size == len(hf)
  assert ours.bos_id == hf.bos_token_id


def test_eos_ids_from_generation_config_then_config_then_eos_token(pairs):
  chatml, hf_chatml = pairs["chatml"]
  assert chatml.eos_ids == tuple(hf_chatml.convert_tokens_to_ids(["</s>", "<|im_end|>"]))
  llama3, hf_llama3 = pairs["llama3"]
  assert llama3.eos_ids == (hf_llama3.convert_tokens_to_ids("<|eot_id|>"),)
  wordpiece, hf_wordpiece = pairs["wordpiece"]
  assert wordpiece.eos_ids == (hf_wordpiece.eos_token_id,)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
@pytest.mark.parametrize("messages", MESSAGES.values(), ids=MESSAGES.keys())
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(pairs, name, messages, add_generation_prompt):
  ours, hf = pairs[name]
  text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  assert text == hf.apply_chat_template(messages, tokenize=False,
                                        add_generation_prompt=add_generation_prompt)
  # The interface's chat prompt ids are transformers' tokenized chat.
  assert ours.encode(text, add_special_tokens=False) == hf.apply_chat_template(
      messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt)


TEMPLATE_FEATURES = {
    "generation_block": "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
                        "{% endfor %}",
    "loop_controls": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                     "{{ m['content'] }}|{% endfor %}",
    "tojson": "{{ messages | tojson }}\n{{ messages[-1] | tojson(indent=2, sort_keys=True) }}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                 "{% endfor %}{{ ns.n }}",
    "whitespace_control": "{%- for m in messages -%}\n  {{ m['role'] }}\n  {% if true %}\n"
                          "x{% endif %}\n{%- endfor %}\n",
    "special_tokens": "{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ unk_token }}",
    "strftime_now": "{{ strftime_now('%Y') }}",
}


@pytest.mark.parametrize("template", TEMPLATE_FEATURES.values(), ids=TEMPLATE_FEATURES.keys())
def test_template_environment_equals_transformers(pairs, template):
  ours, hf = pairs["chatml"]
  for messages in MESSAGES.values():
    assert render_chat_template(template, messages, True, ours.special_tokens) == (
        hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                               add_generation_prompt=True))


def test_chat_template_sees_bos_token_and_default_adds_generation_prompt(pairs):
  llama3, _ = pairs["llama3"]
  text = llama3.apply_chat_template(MESSAGES["single_user"])
  assert text.startswith("<s><|start_header_id|>user")
  assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_template_raise_exception_is_a_value_error(pairs):
  llama3, hf = pairs["llama3"]
  bad = [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]
  with pytest.raises(jinja2.exceptions.TemplateError, match="Unsupported role: wizard"):
    hf.apply_chat_template(bad, tokenize=False)
  with pytest.raises(ValueError, match="Unsupported role: wizard"):
    llama3.apply_chat_template(bad)


def test_chat_without_template_or_with_bad_messages_is_a_clear_error(pairs):
  wordpiece, _ = pairs["wordpiece"]
  with pytest.raises(ValueError, match="no chat_template"):
    wordpiece.apply_chat_template(MESSAGES["single_user"])
  chatml, _ = pairs["chatml"]
  with pytest.raises(ValueError, match="non-empty list"):
    chatml.apply_chat_template([])
  with pytest.raises(ValueError, match=r"messages\[1\] must be a dict"):
    chatml.apply_chat_template([{"role": "user", "content": "a"}, "b"])
  with pytest.raises(ValueError, match="must be a str"):
    chatml.encode(b"bytes")
  with pytest.raises(ValueError, match="-1"):
    chatml.decode([5, -1])


def _stream(tok: HFTokenizer, ids: list[int], chunks: list[int], skip=True) -> list[str]:
  detok = tok.detokenizer(skip_special_tokens=skip)
  pieces, start = [], 0
  for size in chunks:
    pieces.append(detok.push(ids[start:start + size]))
    start += size
  return pieces + [detok.push(ids[start:]), detok.flush()]


@pytest.mark.parametrize("name", ["chatml", "wordpiece", "sentencepiece"])
@pytest.mark.parametrize("label", ["cjk", "emoji", "accents", "cleanup_bait", "special_text"])
def test_token_by_token_stream_equals_decode_without_replacement_chars(pairs, name, label):
  ours, hf = pairs[name]
  ids = hf.encode(TEXTS[label])
  for skip in (True, False):
    pieces = _stream(ours, ids, [1] * len(ids), skip)
    assert "".join(pieces) == hf.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces), pieces


def test_stream_holds_back_characters_split_across_tokens(pairs):
  """The byte-level vocabulary splits some of these characters over several tokens."""
  chatml, _ = pairs["chatml"]
  ids = chatml.encode(TEXTS["emoji"] + TEXTS["cjk"], add_special_tokens=False)
  split = [i for i in ids if "\ufffd" in chatml.decode([i])]
  assert len(split) >= 4  # the test is only meaningful if splits happen
  pieces = _stream(chatml, ids, [1] * len(ids))
  assert pieces.count("") >= len(split) // 2  # pushes that completed no character


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(data=st.data(), name=st.sampled_from(["chatml", "wordpiece", "sentencepiece"]),
                  skip=st.booleans())
def test_any_ids_in_any_chunks_stream_to_decode(pairs, data, name, skip):
  """Arbitrary ids (broken UTF-8 and specials included), pushed in arbitrary chunks."""
  ours, hf = pairs[name]
  ids = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=40), label="ids")
  chunks = data.draw(st.lists(st.integers(0, 4), max_size=len(ids)), label="chunks")
  assert "".join(_stream(ours, ids, chunks, skip)) == hf.decode(ids, skip_special_tokens=skip)


def test_legacy_special_tokens_map_overrides_the_config(dirs, tmp_path):
  """Without added_tokens_decoder in the config, special_tokens_map.json's tokens win (an
  AddedToken dict, and a token new to the vocabulary)."""
  shutil.copytree(dirs["chatml"], tmp_path / "ckpt")
  _edit_json(str(tmp_path / "ckpt" / "special_tokens_map.json"), pad_token="<pad>",
             bos_token={"content": "<|im_start|>", "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False})
  ours = load_tokenizer(str(tmp_path / "ckpt"))
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "ckpt"))
  assert (ours.bos_id, ours.vocab_size) == (hf.bos_token_id, len(hf))
  assert hf.bos_token == "<|im_start|>" and hf.pad_token == "<pad>"
  template = TEMPLATE_FEATURES["special_tokens"]
  assert render_chat_template(template, MESSAGES["single_user"], False, ours.special_tokens) == (
      hf.apply_chat_template(MESSAGES["single_user"], chat_template=template, tokenize=False))
  assert ours.encode("a<pad>b") == hf.encode("a<pad>b")


def test_load_tokenizer_without_tokenizer_json_is_none(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  assert load_tokenizer(str(tmp_path)) is None
  with pytest.raises(ValueError, match="not a directory"):
    load_tokenizer(str(tmp_path / "config.json"))


def test_bad_files_are_errors_naming_them(dirs, tmp_path):
  shutil.copytree(dirs["chatml"], tmp_path / "ckpt")
  _edit_json(str(tmp_path / "ckpt" / "generation_config.json"), eos_token_id=[2, "x"])
  with pytest.raises(ValueError, match="generation_config.json"):
    load_tokenizer(str(tmp_path / "ckpt"))
  (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
  with pytest.raises(ValueError, match="tokenizer.json is not a tokenizers file"):
    load_tokenizer(str(tmp_path / "ckpt"))


def test_loading_needs_no_transformers(dirs):
  code = ("import sys; from kvjax.text.hf_tokenizer import load_tokenizer; "
          f"t = load_tokenizer({dirs['chatml']!r}); t.apply_chat_template([{{'role': 'user', "
          "'content': 'x'}]); assert 'transformers' not in sys.modules, 'transformers imported'")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
