"""kvjax.training.code_eval: which headers become prompts, and the cut rule, on hand-written cases."""
import pytest

from kvjax.training import code_eval

FILE = b'''"""A module."""
import os


@decorator(1)
def decorated(a, b=2):
    """Doc."""
    return a + b


def multi_line(
    first,
    second,
) -> int:
    return first


def one_liner(): return 1


class Skipped:
    def method(self):
        return self


async def fetch(url):
    await url
'''


def test_signatures_are_top_level_headers_without_decorators_or_bodies():
  headers = code_eval.function_signatures([("m.py", FILE)], 3)
  assert sorted(headers) == sorted([
      "def decorated(a, b=2):\n",
      "def multi_line(\n    first,\n    second,\n) -> int:\n",
      "async def fetch(url):\n"])
  # One file's headers are ordered by hash; asking for more than exist is an error.
  assert code_eval.function_signatures([("m.py", FILE)], 3) == headers
  with pytest.raises(ValueError, match="only 3 function headers"):
    code_eval.function_signatures([("m.py", FILE)], 4)
  short = code_eval.function_signatures([("m.py", FILE)], 2, max_chars=25)
  assert "def multi_line(\n    first,\n    second,\n) -> int:\n" not in short


def test_files_take_turns():
  other = b"def a():\n    pass\n\n\ndef b():\n    pass\n"
  headers = code_eval.function_signatures([("m.py", FILE), ("o.py", other)], 2)
  from_first = [h in FILE.decode() for h in headers]
  assert sorted(from_first) == [False, True]  # one from each file


@pytest.mark.parametrize("continuation, finished, kept, parses", [
    # The body ends where a top-level line begins; the half-written line after it goes.
    ("    return x\n\n\ndef next_one(y):\n    ret", False, "    return x\n\n\n", True),
    # No complete line: only the header is left, which does not parse.
    ("    return x", False, "", False),
    # End of file: the last line is complete.
    ("    return x", True, "    return x\n", True),
    # The cut leaves an open block.
    ('    if x:\n        y = 1\n    else:\n        z', False,
     "    if x:\n        y = 1\n    else:\n", False),
    # A docstring that never closes.
    ('    """Doc of the doc of\n    the doc of the\n    doc', False,
     '    """Doc of the doc of\n    the doc of the\n', False),
])
def test_cut_and_parse(continuation, finished, kept, parses):
  assert code_eval.cut_continuation(continuation, finished) == kept
  assert code_eval.completion_parses("def f(x):\n", continuation, finished) == parses


def test_nul_bytes_do_not_parse():
  assert not code_eval.completion_parses("def f(x):\n", "    return '\0'\n", True)
