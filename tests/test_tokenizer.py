"""ByteTokenizer: byte b is id b, specials after 256, lossless on any text."""
import pytest

from kvjax.config import get_preset
from kvjax.tokenizer import ByteTokenizer

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
