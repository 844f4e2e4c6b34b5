"""ByteTokenizer: byte b is id b, specials after 256, lossless on any text, and the
tokenizer interface (streaming text, its chat template) every model tokenizer has."""
from __future__ import annotations

import pytest

from kvjax.model.presets import get_preset
from kvjax.text.tokenizer import ByteTokenizer, Tokenizer

TEXTS = {
    "empty": "",
    "ascii_code": "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n",
    "tabs_and_crlf": "\tx = 1\r\n",
    "multibyte": "naïve café, 日本語, emoji 🐍",
}


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_roundtrip(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert ids == list(text.encode("utf-8"))  # byte b is id b, no BOS
  assert tok.decode(ids) == text


def test_specials_follow_bytes_and_match_preset():
  tok = ByteTokenizer()
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
  cfg = get_preset("tiny-code")
  assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
      tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id)


def test_decode_drops_specials_and_replaces_invalid_utf8():
  tok = ByteTokenizer()
  assert tok.decode([tok.bos_id] + tok.encode("ab") + [tok.eos_id, tok.pad_id]) == "ab"
  # A lone continuation byte and a truncated 3-byte sequence never raise.
  assert tok.decode([0x80, ord("x"), 0xE6, 0x97]) == "\ufffdx\ufffd"


def test_satisfies_the_tokenizer_interface():
  tok = ByteTokenizer()
  assert isinstance(tok, Tokenizer)
  assert tok.eos_ids == (257,)
  assert tok.encode("hi") == [104, 105]  # no BOS by default
  assert tok.encode("hi", add_special_tokens=True) == [256, 104, 105]
  ids = [256, 104, 105, 257, 258]
  assert tok.decode(ids) == "hi"
  assert tok.decode(ids, skip_special_tokens=False) == "<s>hi</s><pad>"
  with pytest.raises(ValueError, match="must be a str"):
    tok.encode(["hi"])
  with pytest.raises(ValueError, match="-3"):
    tok.decode([104, -3])


@pytest.mark.parametrize("skip", [True, False])
def test_byte_by_byte_stream_holds_split_characters(skip):
  tok = ByteTokenizer()
  text = TEXTS["multibyte"]
  ids = [tok.bos_id] + tok.encode(text) + [tok.eos_id]
  detok = tok.detokenizer(skip_special_tokens=skip)
  pieces = [detok.push([i]) for i in ids] + [detok.flush()]
  assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
  assert not any("\ufffd" in p for p in pieces)
  # 🐍 is 4 bytes: its first three pushes complete nothing, the fourth yields it whole.
  snake = text.index("🐍")
  start = 1 + len(text[:snake].encode("utf-8"))
  assert pieces[start:start + 4] == ["", "", "", "🐍"]


def test_stream_of_invalid_utf8_ends_like_decode():
  tok = ByteTokenizer()
  ids = [0x80, ord("x"), 0xE6, 0x97]  # a lone continuation byte, a truncated character
  detok = tok.detokenizer()
  pushed = [detok.push([i]) for i in ids]
  assert pushed == ["", "\ufffdx", "", ""]
  assert "".join(pushed) + detok.flush() == tok.decode(ids) == "\ufffdx\ufffd"


CHATS = {
    "system_user": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                    "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"),
    "multi_turn": ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "日本"}],
                   "<|user|>2+2?\n<|assistant|>4\n<|user|>日本\n<|assistant|>"),
    "text_parts": ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "image_url", "image_url": {}},
                                                 {"type": "text", "text": "b"}]}],
                   "<|user|>ab\n<|assistant|>"),
}


@pytest.mark.parametrize("messages,expected", CHATS.values(), ids=CHATS.keys())
def test_byte_chat_template_renders_role_tagged_lines(messages, expected):
  tok = ByteTokenizer()
  assert tok.apply_chat_template(messages) == expected
  assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
      expected.removesuffix("<|assistant|>"))


def test_byte_chat_template_rejects_unknown_roles_and_empty_chats():
  tok = ByteTokenizer()
  with pytest.raises(ValueError, match="role must be system, user or assistant, got narrator"):
    tok.apply_chat_template([{"role": "narrator", "content": "x"}])
  with pytest.raises(ValueError, match="non-empty list"):
    tok.apply_chat_template([])
