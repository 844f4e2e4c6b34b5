"""kvjax.training.code_corpus on fake wheels built here: dedup kinds, package-level split, pack.

Offline and small (a few KB of generated source).  Oracles are independent of the
module: Jaccard over explicit 5-token tuples (no MinHash), the split recomputed from
hashlib, token streams rebuilt from the zip.
"""
from __future__ import annotations

import hashlib
import random
import re
import zipfile

import numpy as np
import pytest

from kvjax.text.tokenizer import ByteTokenizer
from kvjax.training import code_corpus

HELDOUT_FRACTION = 0.35  # holds out delta (sha256 fraction 0.31), not alpha/beta/zeta
THRESHOLD = 0.7
APACHE = ("# Copyright 2024 The Alpha Authors.\n#\n# Licensed under the Apache License, "
          "Version 2.0 (the \"License\");\n# you may not use this file except in compliance "
          "with the License.\n\n")
MIT = ('"""Copyright (c) 2019 Someone Else.\n\nPermission is hereby granted, free of charge, '
       'to any person obtaining a copy of this software.\n"""\n')


def _functions(seed: int, n: int) -> list:
  """n distinct generated functions (own identifiers and constants per seed)."""
  rng = random.Random(seed)
  word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
  out = []
  for i in range(n):
    name, a, b, c = word(), word(), word(), word()
    out.append(f"def {name}_{i}({a}, {b}):\n"
               f"    {c} = {a} * {rng.randrange(1000)} + {b}\n"
               f"    for {word()} in range({rng.randrange(99)}):\n"
               f"        {c} = {word()}({c}, {a}) - {rng.randrange(1000)}\n"
               f"    return {c}.{word()}({b})\n")
  return out


BASE = "\n\n".join(_functions(0, 40)) + "\n"
NEAR = "\n\n".join(_functions(0, 38) + _functions(1, 2)) + "\n"  # 2 of 40 replaced
HALF = "\n\n".join(_functions(0, 20) + _functions(2, 20)) + "\n"  # below the threshold
OWN_DELTA = "\n\n".join(_functions(3, 30)) + "\n"
TABLE = "T = (\n" + "".join(f"    ({i}, {i * 7 % 256}, {i * 13}),\n" for i in range(600)) + ")\n"

# package -> {path: bytes}; listed so that beta (vendoring alpha) comes before alpha.
WHEELS = {
    "beta": {
        # The whitespace-mangled, relicensed vendored copy: an exact duplicate after
        # normalization; alpha's copy stays because this one sits in _vendor/.
        "beta/_vendor/alpha_core.py": (MIT + BASE.replace("\n", "  \n") + "\n\n").encode(),
        "beta/main.py": "\n\n".join(_functions(4, 30)).encode(),
    },
    "alpha": {
        "alpha/__init__.py": b"from alpha.core import *\n",
        "alpha/core.py": (APACHE + BASE).encode(),
        "alpha/util.py": "\n\n".join(_functions(5, 30)).encode(),
        "alpha/table.py": TABLE.encode(),  # numeric_table
        "alpha/bad.py": b"x = '\xff\xfe'\n",  # not UTF-8
        "alpha/empty.py": b"\n",
        "alpha/sub/__init__.py": APACHE.encode(),  # license_only
        "alpha/tests/test_core.py": b"def test_x():\n    assert True\n",
        "alpha/test_util.py": b"def test_y():\n    assert True\n",
    },
    "delta": {  # held out by its name's hash
        "delta/core_fork.py": NEAR.encode(),  # near copy of alpha/core.py: removed
        "delta/half.py": HALF.encode(),  # shares half of it: kept
        "delta/own.py": OWN_DELTA.encode(),
    },
    "gamma": {  # the unseen package
        "gamma/own_copy.py": (APACHE + OWN_DELTA).encode(),  # exact copy of delta/own.py
        "gamma/graph.py": "\n\n".join(_functions(6, 30)).encode(),
    },
    "zeta": {"zeta/tools.py": "\n\n".join(_functions(7, 30)).encode()},
}


def _write_wheel(path, files: dict) -> None:
  with zipfile.ZipFile(path, "w") as z:
    for name, data in files.items():
      z.writestr(name, data)
    z.writestr("pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: pkg\n")


def _shingle_jaccard(x: bytes, y: bytes) -> float:
  def grams(data):
    toks = re.findall(r"\w+|[^\w\s]", code_corpus.normalize(data.decode()))
    return {tuple(toks[i:i + 5]) for i in range(len(toks) - 4)}
  gx, gy = grams(x), grams(y)
  return len(gx & gy) / len(gx | gy)


def _oracle_split(name: str) -> str:
  if name == "gamma":
    return "unseen"
  fraction = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 2**32
  return "heldout" if fraction < HELDOUT_FRACTION else "train"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  root = tmp_path_factory.mktemp("wheels")
  out = []
  for name, files in WHEELS.items():
    path = root / f"{name}-1.0-py3-none-any.whl"
    _write_wheel(path, files)
    out.append(code_corpus.wheel_sources(str(path), name, "1.0"))
  return out


@pytest.fixture(scope="module")
def corpus(sources):
  return code_corpus.build(sources, HELDOUT_FRACTION, ("gamma",), THRESHOLD)


def test_wheel_listing_skips_tests_tables_and_bad_text(sources):
  alpha = next(s for s in sources if s.name == "alpha")
  assert [p for p, _ in alpha.files] == ["alpha/__init__.py", "alpha/core.py", "alpha/util.py"]
  assert alpha.skipped == {"tests": 2, "numeric_table": 1, "not_text": 1, "empty": 1,
                           "license_only": 1}
  assert all(not p.endswith("METADATA") for s in sources for p, _ in s.files)


@pytest.mark.parametrize("text, stripped", [
    (APACHE + "import os\n", "import os"),
    (MIT + "import os\n", "\nimport os"),
    ("#!/usr/bin/env python\n# SPDX-License-Identifier: MIT\nx = 1\n", "x = 1"),
    ("# helper functions for x\nimport os\n", "# helper functions for x\nimport os"),
    ('"""Parses the config files."""\nimport os\n', '"""Parses the config files."""\nimport os'),
])
def test_strip_license_header(text, stripped):
  assert code_corpus.strip_license_header(text) == stripped


def test_fixture_pairs_sit_where_the_threshold_says():
  assert _shingle_jaccard((APACHE + BASE).encode(), NEAR.encode()) >= THRESHOLD
  assert _shingle_jaccard((APACHE + BASE).encode(), HALF.encode()) < THRESHOLD


def test_dedup_removes_exact_and_near_copies_keeping_the_original(corpus):
  removed = {(r.package, r.path): (r.kind, r.kept_as) for r in corpus.removed}
  assert removed == {
      ("beta", "beta/_vendor/alpha_core.py"): ("exact", "alpha/alpha/core.py"),
      ("gamma", "gamma/own_copy.py"): ("exact", "delta/delta/own.py"),
      ("delta", "delta/core_fork.py"): ("near", "alpha/alpha/core.py"),
  }
  near = next(r for r in corpus.removed if r.kind == "near")
  assert near.jaccard == pytest.approx(
      _shingle_jaccard(WHEELS["alpha"]["alpha/core.py"], NEAR.encode()), abs=1e-4)
  kept = {f"{f.package}/{f.path}" for f in corpus.files}
  assert {"alpha/alpha/core.py", "delta/delta/half.py", "delta/delta/own.py"} <= kept
  assert len(kept) == 8


def test_kept_files_are_stored_as_they_are(corpus):
  for f in corpus.files:
    data = WHEELS[f.package][f.path]
    assert corpus.data[f"{f.package}/{f.path}"] == data
    assert f.sha256 == hashlib.sha256(data).hexdigest() and f.num_bytes == len(data)


def test_split_is_by_package_name_and_leaves_no_near_copy_across_splits(corpus):
  assert {f.package: f.split for f in corpus.files} == {
      "beta": "train", "alpha": "train", "delta": "heldout", "gamma": "unseen",
      "zeta": "train"}
  for f in corpus.files:
    assert f.split == _oracle_split(f.package)
  train = [corpus.data[f"{f.package}/{f.path}"] for f in corpus.split_files("train")]
  for split in ("heldout", "unseen"):
    for f in corpus.split_files(split):
      held = corpus.data[f"{f.package}/{f.path}"]
      assert max(_shingle_jaccard(held, t) for t in train) < THRESHOLD


def test_split_depends_on_the_name_only(tmp_path):
  """Same files under another name move split; other sources do not move a package."""
  path = tmp_path / "w.whl"
  _write_wheel(path, WHEELS["delta"])
  for name in ("delta", "zeta", "eta"):
    alone = code_corpus.build([code_corpus.wheel_sources(str(path), name, "1.0")],
                              HELDOUT_FRACTION)
    assert {f.split for f in alone.files} == {_oracle_split(name)}
  names = [f"pkg{i}" for i in range(200)]
  splits = [code_corpus.split_of(n, HELDOUT_FRACTION, ("pkg7",)) for n in names]
  assert splits == [_oracle_split(n) if n != "pkg7" else "unseen" for n in names]
  assert 0.2 < splits.count("heldout") / len(names) < 0.5


def test_build_rejects_unknown_unseen_and_duplicate_names(sources):
  with pytest.raises(ValueError, match="unseen"):
    code_corpus.build(sources, HELDOUT_FRACTION, ("nope",))
  with pytest.raises(ValueError, match="duplicate"):
    code_corpus.build([sources[0], sources[0]], HELDOUT_FRACTION)


def test_manifest_pack_and_tokens_round_trip(corpus, tmp_path):
  packages = [{"name": n, "version": "1.0"} for n in WHEELS]
  record = code_corpus.manifest(corpus, packages, {})
  assert record["dedup"] == {"exact": 2, "near": 1, "kept": 8}
  for split in code_corpus.SPLITS:
    assert record["splits"][split]["bytes"] == sum(
        len(WHEELS[f.package][f.path]) for f in corpus.split_files(split))
  path = tmp_path / "manifest.json"
  path.write_text(code_corpus.manifest_json(record))
  loaded = code_corpus.load_manifest(str(path))
  assert loaded == record
  pack = tmp_path / "pack.zip"
  code_corpus.write_pack(corpus, str(pack))
  tok = ByteTokenizer()
  for split in code_corpus.SPLITS:
    expected = []
    for f in corpus.split_files(split):
      expected += [tok.bos_id, *WHEELS[f.package][f.path], tok.eos_id]
    np.testing.assert_array_equal(code_corpus.split_tokens(loaded, str(pack), split),
                                  np.array(expected, np.int32))
  second = tmp_path / "pack2.zip"
  code_corpus.write_pack(corpus, str(second))
  assert pack.read_bytes() == second.read_bytes()  # reproducible bytes


def test_split_tokens_refuses_a_changed_file(corpus, tmp_path):
  record = code_corpus.manifest(corpus, [{"name": n, "version": "1.0"} for n in WHEELS], {})
  pack = tmp_path / "pack.zip"
  with zipfile.ZipFile(pack, "w") as z:
    for f in corpus.files:
      data = corpus.data[f"{f.package}/{f.path}"]
      z.writestr(f"{f.package}/{f.path}", data + b"#" if f.package == "delta" else data)
  assert len(code_corpus.split_tokens(record, str(pack), "train")) > 0
  with pytest.raises(ValueError, match="does not match"):
    code_corpus.split_tokens(record, str(pack), "heldout")
