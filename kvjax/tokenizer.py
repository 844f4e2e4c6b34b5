"""Byte-level tokenizer of the built-in default model: byte b is token id b.

No vocabulary file exists or is ever downloaded; the special ids follow the 256
byte ids.
"""
from __future__ import annotations

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
  """UTF-8 bytes <-> ids; specials BOS=256, EOS=257, PAD=258."""

  num_bytes = 256
  bos_id = 256
  eos_id = 257
  pad_id = 258
  vocab_size = 259

  def encode(self, text: str) -> list[int]:
    """Text -> byte ids (no BOS)."""
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    """Ids -> text; specials are dropped and invalid UTF-8 is replaced, never raised."""
    return bytes(int(i) for i in ids if 0 <= int(i) < self.num_bytes).decode(
        "utf-8", errors="replace")
