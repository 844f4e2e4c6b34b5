"""experiments/structured_bench.py's output check against hand-written documents: a
length-cut output passes when every record it finished validates under the schema."""
from __future__ import annotations

import pytest

from experiments import structured_bench as bench
from kvjax.text.tokenizer import ByteTokenizer

RECORD = '{"name":"Ann Lee","age":31,"role":"admin"}'


@pytest.mark.parametrize("text, valid", [
    ("[" + RECORD + "," + RECORD + ',{"name":"Bo', True),  # cut inside the third record
    ("[" + RECORD + ",", True),
    ("[" + RECORD.replace("31", "131") + "," + RECORD, False),  # age above its maximum
    ("[" + RECORD.replace("admin", "root") + ",", False),  # role outside its enum
    ("[" + RECORD.replace('"Ann Lee"', '"Ann_Lee"') + ",", False),  # name pattern
    (RECORD + ",", False),  # not an array
])
def test_valid_prefix(text, valid):
  tokenizer = ByteTokenizer()
  assert bench.valid_prefix(tokenizer, tokenizer.encode(text)) == valid
