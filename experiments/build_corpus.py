r"""Fetches the pinned wheels, builds the deduplicated code corpus, writes its manifest.

  python -m experiments.build_corpus --config=configs/build_corpus.py

The only kvjax program that downloads: `pip download` by exact version into
config.cache_dir, then every wheel's sha256 is checked against the pinned one (a
wheel already in the cache with the right sha256 is not fetched again).  The
corpus itself is kvjax.training.code_corpus's: the manifest goes to config.manifest and
the pack of kept files to <cache_dir>/<pack_name>, which training reads.
"""
from __future__ import annotations

import email.parser
import glob
import hashlib
import os
import subprocess
import sys
import time
import zipfile

from absl import app, logging
from ml_collections import config_flags

from kvjax.training import code_corpus

_CONFIG = config_flags.DEFINE_config_file("config", "configs/build_corpus.py",
                                          "Corpus build config.", lock_config=True)


def file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _cached_wheel(cache_dir: str, name: str, version: str, sha256: str):
  """The cached wheel of name==version whose sha256 is the pinned one, or None."""
  for path in glob.glob(os.path.join(cache_dir, f"{name}-{version}-*.whl")):
    if file_sha256(path) == sha256:
      return path
  return None


def fetch(config, name: str, version: str, sha256: str) -> str:
  """Path of the verified wheel of name==version in the cache; downloads it if needed."""
  cache_dir = os.path.expanduser(config.cache_dir)
  path = _cached_wheel(cache_dir, name, version, sha256)
  if path:
    return path
  platforms = [a for p in config.pip_platforms for a in ("--platform", p)]
  python = config.pip_python_version
  subprocess.run(
      [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
       *platforms, "--python-version", python, "--implementation", "cp",
       "--abi", "cp" + python.replace(".", ""), "--dest", cache_dir, f"{name}=={version}"],
      check=True)
  path = _cached_wheel(cache_dir, name, version, sha256)
  if path is None:
    got = {os.path.basename(p): file_sha256(p)
           for p in glob.glob(os.path.join(cache_dir, f"{name}-{version}-*.whl"))}
    raise ValueError(f"{name}=={version}: no wheel with the pinned sha256 {sha256}; "
                     f"the cache holds {got}")
  return path


def wheel_license(path: str) -> str:
  """The METADATA license field (License-Expression, License, else the classifiers)."""
  with zipfile.ZipFile(path) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = email.parser.HeaderParser().parsestr(z.read(meta).decode("utf-8"))
  classifiers = [c.split(" :: ")[-1] for c in msg.get_all("Classifier", [])
                 if c.startswith("License ::")]
  return (msg.get("License-Expression") or "; ".join(classifiers)
          or (msg.get("License") or "").splitlines()[0])


def build(config) -> dict:
  """Fetches, builds and writes the manifest and the pack; returns the manifest."""
  cache_dir = os.path.expanduser(config.cache_dir)
  os.makedirs(cache_dir, exist_ok=True)
  filters = dict(max_file_bytes=config.max_file_bytes,
                 max_numeric_fraction=config.max_numeric_fraction)
  sources, packages = [], []
  if config.include_stdlib:
    sources.append(code_corpus.stdlib_source(**filters))
    packages.append({"name": code_corpus.STDLIB, "version": sources[0].version,
                     "license": "PSF-2.0"})
  for name, version, sha256 in config.packages:
    path = fetch(config, name, version, sha256)
    sources.append(code_corpus.wheel_sources(path, name, version, exclude=config.exclude,
                                             **filters))
    packages.append({"name": name, "version": version, "filename": os.path.basename(path),
                     "sha256": sha256, "license": wheel_license(path)})
    logging.info("%s==%s: %d files kept of the wheel's .py files; %s", name, version,
                 len(sources[-1].files), sources[-1].skipped)

  t = time.time()
  corpus = code_corpus.build(sources, config.heldout_fraction, config.unseen,
                             config.near_threshold)
  logging.info("dedup and split: %.0f s", time.time() - t)
  record = code_corpus.manifest(corpus, packages, dict(
      exclude=list(config.exclude), pip_platforms=list(config.pip_platforms),
      pip_python_version=config.pip_python_version, **filters))
  pack = os.path.join(cache_dir, config.pack_name)
  code_corpus.write_pack(corpus, pack)
  record["pack"] = {"name": config.pack_name, "sha256": file_sha256(pack),
                    "bytes": os.path.getsize(pack)}
  os.makedirs(os.path.dirname(os.path.abspath(config.manifest)), exist_ok=True)
  with open(config.manifest, "w") as f:
    f.write(code_corpus.manifest_json(record))
  return record


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  config = _CONFIG.value
  record = build(config)
  for split, s in record["splits"].items():
    logging.info("%-7s %5d files %12s bytes  %s", split, s["files"], f"{s['bytes']:,}",
                 ", ".join(s["packages"]) if split != "train" else f"{len(s['packages'])} "
                 "packages")
  logging.info("dedup removed %d exact and %d near duplicates; kept %d files",
               record["dedup"]["exact"], record["dedup"]["near"], record["dedup"]["kept"])
  logging.info("manifest %s (%s bytes), pack %s (%s bytes)", config.manifest,
               f"{os.path.getsize(config.manifest):,}",
               os.path.join(config.cache_dir, config.pack_name), f"{record['pack']['bytes']:,}")


if __name__ == "__main__":
  app.run(main)
