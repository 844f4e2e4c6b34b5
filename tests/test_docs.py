"""The docs name what exists: every `kvjax.NAME` and `from kvjax... import ...` in the
README's and docs' Python blocks resolves, the README's EngineConfig is a valid one, and
every relative link points at a file in the repository."""
from __future__ import annotations

import ast
import importlib
import os
import re

import pytest

import kvjax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + [os.path.join("docs", name) for name in
                        sorted(os.listdir(os.path.join(ROOT, "docs"))) if name.endswith(".md")]
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _read(doc: str) -> str:
  with open(os.path.join(ROOT, doc)) as f:
    return f.read()


def _python_blocks(doc: str) -> list[str]:
  return _BLOCK.findall(_read(doc))


@pytest.mark.parametrize("doc", DOCS)
def test_every_kvjax_name_in_a_python_block_exists(doc):
  for block in _python_blocks(doc):
    for dotted in re.findall(r"\bkvjax((?:\.[A-Za-z_]\w*)+)", block):
      target = kvjax
      for part in dotted.strip(".").split("."):
        if not hasattr(target, part):  # a submodule not imported by the package
          target = importlib.import_module(f"{target.__name__}.{part}")
        else:
          target = getattr(target, part)


@pytest.mark.parametrize("doc", DOCS)
def test_every_import_in_a_python_block_imports(doc):
  for block in _python_blocks(doc):
    for line in block.splitlines():
      statement = line.split("#")[0].rstrip()
      if re.match(r"(from kvjax[\w.]* import |import kvjax)", statement):
        exec(compile(ast.parse(statement), doc, "exec"), {})


def test_readme_engine_config_is_valid():
  block = _python_blocks("README.md")[0]
  call = re.search(r"kvjax\.EngineConfig\((.*?)\)\n", block, re.DOTALL).group(1)
  config = eval(f"kvjax.EngineConfig({call})", {"kvjax": kvjax})
  assert config.speculative == "ngram" and config.kv_dtype == "int8"


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_point_at_files(doc):
  here = os.path.dirname(os.path.join(ROOT, doc))
  for target in _LINK.findall(_read(doc)):
    if "://" in target:
      continue
    assert os.path.exists(os.path.join(here, target)), f"{doc}: link to {target}"
