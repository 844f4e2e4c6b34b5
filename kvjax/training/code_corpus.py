"""Code corpus of the next default model: the stdlib plus pinned PyPI packages, deduplicated.

Sources.  The running interpreter's stdlib (kvjax.training.corpus's listing, all of it, as one
source named `python-stdlib`) and the `.py` files read straight out of pinned wheels
(zip files; nothing is installed).  experiments/build_corpus.py fetches the wheels by
exact version and checks their sha256s; this module never downloads.  Left out before
dedup, with counts per reason: a wheel's tests (`tests/`, `test/`, test data dirs,
`test_*.py`, `*_test.py`, `conftest.py`), paths matching a config glob, empty files,
files that are only a license header, files over `max_file_bytes`, files that are not
clean UTF-8 text, and generated numeric tables (over `max_numeric_fraction` of a
1,000+ word file's words are number literals: idna's Unicode tables, ANTLR lexers).

Deduplication, before splitting, over all sources together:
  * the text hashed is *normalized*: a leading license header (a comment block, or a
    docstring, that names a license or copyright) is stripped, trailing spaces and
    blank lines are dropped; the corpus keeps each file as it is;
  * exact: same sha256 of the normalized text;
  * near: Jaccard similarity >= `near_threshold` between the sets of 5-token shingles,
    found through MinHash signatures and joined into clusters
    (kvjax/training/near_duplicates.py); this catches generated tables (the stdlib's
    cp*.py / mac_*.py codecs), vendored copies (pip/_vendor/rich vs rich) and copied
    model files (transformers' sibling models).
  * one file per cluster is kept: a copy outside a vendoring directory first, then the
    earlier source (the stdlib, then the pinned list's order), then the path.

Split: by whole package, from its name only.  `python-stdlib` is always train; the
`unseen` packages form their own held-out set; any other package is held out iff the
first 8 hex digits of sha256(name), as a fraction of 2**32, fall below
`heldout_fraction`.  Because dedup ran first, no held-out text has a near copy in
train.

Pack: the kept files in one zip (`<package>/<path>`, fixed timestamps, so the same
bytes on every build), the only thing training reads; `split_tokens` checks each file
against the manifest's sha256.  Token stream of a split: BOS, bytes, EOS per file in
manifest order.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import re
import zipfile
from typing import Iterable, Optional, Sequence

import numpy as np

from kvjax.text.tokenizer import ByteTokenizer
from kvjax.training import corpus as stdlib_corpus
from kvjax.training import near_duplicates

__all__ = ["Source", "KeptFile", "Removed", "CodeCorpus", "STDLIB", "SPLITS",
           "wheel_sources", "stdlib_source", "strip_license_header", "normalize",
           "split_of", "build", "manifest", "manifest_json", "load_manifest", "write_pack",
           "split_texts", "split_tokens", "summary"]

STDLIB = "python-stdlib"
SPLITS = ("train", "heldout", "unseen")
_TEST_DIRS = frozenset({"test", "tests", "testdata", "test_data", "internal_test_util",
                        "__pycache__"})
_VENDOR_DIRS = frozenset({"_vendor", "vendor", "vendored", "_vendored", "third_party",
                          "externals", "_external"})
_LICENSE_RE = re.compile(r"copyright|licen[cs]e|spdx-|permission is hereby granted", re.I)
_PACK_DATE = (1980, 1, 1, 0, 0, 0)  # fixed zip timestamps: the pack's bytes are reproducible


@dataclasses.dataclass(frozen=True)
class Source:
  name: str  # package name, normalized ('absl_py', 'python-stdlib')
  version: str
  files: tuple  # tuple[(path, bytes), ...] in listing order
  skipped: dict  # reason -> number of .py files left out before dedup


@dataclasses.dataclass(frozen=True)
class KeptFile:
  package: str
  path: str
  sha256: str  # of the file's bytes as stored
  num_bytes: int
  split: str


@dataclasses.dataclass(frozen=True)
class Removed:
  package: str
  path: str
  kind: str  # 'exact' or 'near'
  kept_as: str  # '<package>/<path>' of the copy that stays
  jaccard: float  # 1.0 for exact; near: its highest Jaccard with a file of its cluster


@dataclasses.dataclass(frozen=True)
class CodeCorpus:
  files: tuple  # tuple[KeptFile, ...] in source, then path order
  removed: tuple  # tuple[Removed, ...]
  skipped: dict  # package -> {reason: count}
  heldout_fraction: float
  unseen: tuple  # package names of the unseen split
  near_threshold: float
  data: dict  # '<package>/<path>' -> bytes of every kept file (not in the manifest)

  def split_files(self, split: str) -> tuple:
    _check_split(split)
    return tuple(f for f in self.files if f.split == split)


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _is_test(path: str) -> bool:
  parts = path.split("/")
  name = parts[-1]
  return (bool(_TEST_DIRS.intersection(parts[:-1])) or name.startswith("test_")
          or name.endswith("_test.py") or name == "conftest.py")


def _numeric_fraction(text: str) -> float:
  """Share of the words that are number literals, 0 for files under 1,000 words."""
  words = [t for t in near_duplicates.TOKEN_RE.findall(text) if t[0].isalnum() or t[0] == "_"]
  return 0.0 if len(words) < 1000 else sum(w[0].isdigit() for w in words) / len(words)


def _skip_reason(data: bytes, max_file_bytes: int, max_numeric_fraction: float):
  if not data.strip():
    return "empty"
  if len(data) > max_file_bytes:
    return "too_large"
  if not stdlib_corpus._is_source_text(data):  # the stdlib listing's rule, for every source
    return "not_text"
  text = data.decode("utf-8")
  if not normalize(text):
    return "license_only"  # e.g. an __init__.py holding just a license header
  if _numeric_fraction(text) > max_numeric_fraction:
    return "numeric_table"  # a generated table with no near copy (idna's, ANTLR's)
  return None


def _filter(items: Iterable, max_file_bytes: int, max_numeric_fraction: float) -> tuple:
  """(path, bytes) pairs -> (kept pairs, {reason: count})."""
  kept, skipped = [], {}
  for path, data in items:
    reason = _skip_reason(data, max_file_bytes, max_numeric_fraction)
    if reason:
      skipped[reason] = skipped.get(reason, 0) + 1
    else:
      kept.append((path, data))
  return tuple(kept), skipped


def wheel_sources(wheel_path: str, name: str, version: str, exclude: Sequence[str] = (),
                  max_file_bytes: int = 500_000, max_numeric_fraction: float = 0.4) -> Source:
  """The `.py` files of one wheel, read out of the zip, sorted by path.

  Left out: tests, paths matching an `exclude` glob, and `_skip_reason`'s files.
  """
  with zipfile.ZipFile(wheel_path) as z:
    names = sorted(n for n in z.namelist() if n.endswith(".py") and ".dist-info/" not in n)
    tests = [n for n in names if _is_test(n)]
    excluded = [n for n in names if any(fnmatch.fnmatch(n, g) for g in exclude)]
    left_out = set(tests) | set(excluded)
    items = [(n, z.read(n)) for n in names if n not in left_out]
  files, skipped = _filter(items, max_file_bytes, max_numeric_fraction)
  skipped.update({k: v for k, v in (("tests", len(tests)), ("excluded", len(excluded))) if v})
  return Source(name, version, files, skipped)


def stdlib_source(root: Optional[str] = None, max_file_bytes: int = 500_000,
                  max_numeric_fraction: float = 0.4) -> Source:
  """Every file of kvjax.training.corpus's stdlib listing (its own split is not used here)."""
  listing = stdlib_corpus.load_corpus(root)
  items = []
  for f in listing.files:
    with open(f"{listing.root}/{f.path}", "rb") as fh:
      items.append((f.path, fh.read()))
  files, skipped = _filter(items, max_file_bytes, max_numeric_fraction)
  return Source(STDLIB, listing.python_version, files, skipped)


def strip_license_header(text: str) -> str:
  """The text without a leading comment block or docstring that names a license."""
  lines = text.splitlines()
  i = 0
  while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
    i += 1
  if _LICENSE_RE.search("\n".join(lines[:i])):
    lines = lines[i:]
  rest = "\n".join(lines).lstrip()
  for quote in ('"""', "'''"):
    for prefix in ("", "r", "R"):
      if rest.startswith(prefix + quote):
        end = rest.find(quote, len(prefix) + 3)
        if end >= 0 and _LICENSE_RE.search(rest[:end]):
          return rest[end + 3:]
  return "\n".join(lines)


def normalize(text: str) -> str:
  """What dedup hashes: no license header, no trailing spaces, no blank lines."""
  lines = (line.rstrip() for line in strip_license_header(text).splitlines())
  return "\n".join(line for line in lines if line)


def split_of(name: str, heldout_fraction: float, unseen: Sequence[str]) -> str:
  """The split of every file of package `name`: a function of the name alone."""
  if name == STDLIB:
    return "train"
  if name in unseen:
    return "unseen"
  fraction = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 2**32
  return "heldout" if fraction < heldout_fraction else "train"


def _preference(key: tuple) -> tuple:
  source_index, path = key
  return (bool(_VENDOR_DIRS.intersection(path.split("/")[:-1])), source_index, path)


def build(sources: Sequence[Source], heldout_fraction: float = 0.1,
          unseen: Sequence[str] = (), near_threshold: float = 0.7) -> CodeCorpus:
  """Deduplicates all sources together, then splits the survivors by package."""
  names = [s.name for s in sources]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate source names in {names}")
  if missing := set(unseen) - set(names):
    raise ValueError(f"unseen packages {sorted(missing)} are not among the sources")
  entries = [(si, path, data) for si, s in enumerate(sources) for path, data in s.files]

  def label(entry) -> str:
    return f"{sources[entry[0]].name}/{entry[1]}"

  order = sorted(range(len(entries)), key=lambda k: _preference(entries[k][:2]))

  removed, first_by_hash, survivors, texts = [], {}, [], []
  for k in order:  # exact duplicates: the preferred copy comes first
    text = normalize(entries[k][2].decode("utf-8"))
    digest = hashlib.sha256(text.encode()).hexdigest()
    if digest in first_by_hash:
      si, path, _ = entries[k]
      removed.append(Removed(sources[si].name, path, "exact",
                             label(entries[first_by_hash[digest]]), 1.0))
    else:
      first_by_hash[digest] = k
      survivors.append(k)
      texts.append(text)

  roots, best_jaccard = near_duplicates.clusters(texts, near_threshold)
  kept = set()
  for i, k in enumerate(survivors):
    r = roots[i]
    if r == i:
      kept.add(k)
    else:
      si, path, _ = entries[k]
      removed.append(Removed(sources[si].name, path, "near", label(entries[survivors[r]]),
                             round(best_jaccard[i], 4)))

  files, data = [], {}
  for k in sorted(kept):  # entries are in source, then path order
    si, path, blob = entries[k]
    name = sources[si].name
    files.append(KeptFile(name, path, hashlib.sha256(blob).hexdigest(), len(blob),
                          split_of(name, heldout_fraction, unseen)))
    data[f"{name}/{path}"] = blob
  removed.sort(key=lambda r: (names.index(r.package), r.path))
  return CodeCorpus(tuple(files), tuple(removed), {s.name: dict(s.skipped) for s in sources},
                    heldout_fraction, tuple(unseen), near_threshold, data)


def manifest(corpus: CodeCorpus, packages: Sequence[dict], config: dict) -> dict:
  """JSON-ready record: packages, per-file [path, sha256, bytes], dedup counts, bytes/split.

  `packages`: one dict per source (name, version, and for wheels filename, sha256,
  license), in source order; `config`: the build settings to record.
  """
  per_package = {p["name"]: [] for p in packages}
  for f in corpus.files:
    per_package[f.package].append([f.path, f.sha256, f.num_bytes])
  removed_by = {}
  for r in corpus.removed:
    counts = removed_by.setdefault(r.package, {"exact": 0, "near": 0})
    counts[r.kind] += 1
  rows = []
  for p in packages:
    split = split_of(p["name"], corpus.heldout_fraction, corpus.unseen)
    kept = per_package[p["name"]]
    rows.append(dict(p, split=split, kept_files=len(kept),
                     kept_bytes=sum(f[2] for f in kept),
                     removed=removed_by.get(p["name"], {"exact": 0, "near": 0}),
                     skipped=corpus.skipped.get(p["name"], {})))
  splits = {}
  for split in SPLITS:
    files = corpus.split_files(split)
    splits[split] = {"packages": sorted({f.package for f in files}), "files": len(files),
                     "bytes": sum(f.num_bytes for f in files)}
  skipped = {}
  for counts in corpus.skipped.values():
    for reason, n in counts.items():
      skipped[reason] = skipped.get(reason, 0) + n
  listing = "".join(f"{f.sha256}  {f.package}/{f.path}\n" for f in corpus.files)
  return {
      "format": 1,
      "config": dict(config, heldout_fraction=corpus.heldout_fraction,
                     unseen=list(corpus.unseen), near_threshold=corpus.near_threshold,
                     shingle_tokens=near_duplicates.SHINGLE_TOKENS,
                     minhash_permutations=near_duplicates.NUM_PERMUTATIONS),
      "listing_sha256": hashlib.sha256(listing.encode()).hexdigest(),
      "splits": splits,
      "dedup": {
          "exact": sum(r.kind == "exact" for r in corpus.removed),
          "near": sum(r.kind == "near" for r in corpus.removed),
          "kept": len(corpus.files)},
      "skipped": dict(sorted(skipped.items())),  # left out before dedup, by reason
      "packages": rows,
      "files": per_package,
      "removed": [[f"{r.package}/{r.path}", r.kind, r.kept_as, r.jaccard]
                  for r in corpus.removed],
  }


def manifest_json(record: dict) -> str:
  """Indented JSON with each innermost list (a file row, a short list) on one line."""
  text = json.dumps(record, indent=1)
  return re.sub(r"\[[^\[\]{}]*\]", lambda m: re.sub(r"\n\s*", "", m.group()), text) + "\n"


def load_manifest(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def write_pack(corpus: CodeCorpus, path: str) -> None:
  """Every kept file as `<package>/<path>` in one deflated zip with fixed timestamps."""
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for f in corpus.files:
      name = f"{f.package}/{f.path}"
      z.writestr(zipfile.ZipInfo(name, _PACK_DATE), corpus.data[name],
                 compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)


def split_texts(manifest_dict: dict, pack_path: str, split: str) -> list:
  """[(<package>/<path>, bytes)] of every file of `split` in manifest order, each checked
  against its sha256."""
  _check_split(split)
  texts = []
  with zipfile.ZipFile(pack_path) as z:
    for p in manifest_dict["packages"]:
      if p["split"] != split:
        continue
      for path, sha256, _ in manifest_dict["files"][p["name"]]:
        name = f"{p['name']}/{path}"
        data = z.read(name)
        if hashlib.sha256(data).hexdigest() != sha256:
          raise ValueError(f"{name} in {pack_path} does not match the manifest")
        texts.append((name, data))
  if not texts:
    raise ValueError(f"the {split!r} split of {pack_path} has no files")
  return texts


def split_tokens(manifest_dict: dict, pack_path: str, split: str) -> np.ndarray:
  """int32 [n]: BOS + bytes + EOS of every file of `split`, each checked against its sha256."""
  tok = ByteTokenizer()
  chunks = []
  for _, data in split_texts(manifest_dict, pack_path, split):
    chunks += [np.array([tok.bos_id], np.int32),
               np.frombuffer(data, np.uint8).astype(np.int32),
               np.array([tok.eos_id], np.int32)]
  return np.concatenate(chunks)


def summary(manifest_dict: dict) -> dict:
  """The model card's corpus record: packages with versions, split bytes, dedup counts."""
  return {
      "manifest_sha256": hashlib.sha256(manifest_json(manifest_dict).encode()).hexdigest(),
      "packages": {p["name"]: {"version": p["version"], "split": p["split"],
                               "files": p["kept_files"], "bytes": p["kept_bytes"]}
                   for p in manifest_dict["packages"]},
      "splits": manifest_dict["splits"],
      "dedup": manifest_dict["dedup"],
      "skipped": manifest_dict["skipped"],
  }
