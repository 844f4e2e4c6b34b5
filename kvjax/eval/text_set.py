"""The perplexity text: installed CPython standard-library files, fixed by a manifest.

kvjax/assets/eval_text_manifest.json lists files under the interpreter's stdlib directory
(sysconfig's "stdlib" path): the python.org LICENSE.txt (English prose) and
pure-Python modules (textwrap, heapq, colorsys, bisect, shlex, fnmatch,
string: code with docstrings and comments), each with its byte count and
sha256.  The text is those files' bytes in manifest order joined by one blank
line, so every run, on any machine with the same CPython release, scores the
same bytes; a file that is missing or differs is an error naming it, never a
silently different text.  Nothing is downloaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from typing import Optional

__all__ = ["MANIFEST", "load_text", "text_ids"]

MANIFEST = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets",
                        "eval_text_manifest.json")


def load_text(manifest: str = MANIFEST, root: Optional[str] = None) -> str:
  """The manifest's files joined (module doc); ValueError naming a file that differs."""
  with open(manifest) as f:
    spec = json.load(f)
  root = root or sysconfig.get_paths()["stdlib"]
  parts = []
  for entry in spec["files"]:
    path = os.path.join(root, entry["path"])
    if not os.path.isfile(path):
      raise FileNotFoundError(f"perplexity text file {path} is missing (manifest {manifest}, "
                              f"CPython {spec['python']})")
    with open(path, "rb") as f:
      data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
      raise ValueError(f"perplexity text file {path} has sha256 {digest}, the manifest says "
                       f"{entry['sha256']} (CPython {spec['python']}'s file): a different "
                       "text would be scored")
    parts.append(data.decode("utf-8"))
  return "\n\n".join(parts)


def text_ids(tokenizer, manifest: str = MANIFEST) -> list[int]:
  """The text's token ids, no special tokens added (the text is scored as it is)."""
  return tokenizer.encode(load_text(manifest), add_special_tokens=False)
