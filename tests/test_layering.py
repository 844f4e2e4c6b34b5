"""The package's shape: imports only go down the layers written in kvjax/__init__.py,
no import cycle, pallas_kernels never imports kvjax, and no module over 500 lines."""
from __future__ import annotations

import ast
import os
import re

import pytest

import kvjax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 500


def _layers() -> dict[str, int]:
  """Module (or package prefix) -> layer, parsed from kvjax's docstring table."""
  layers, current = {}, None
  table = kvjax.__doc__.split("Layers", 1)[1].split("Shapes", 1)[0]
  for line in table.splitlines()[1:]:
    cells = line.split()
    if not cells:
      continue
    if cells[0].isdigit():
      current, names = int(cells[0]), line.split(None, 1)[1]
    else:
      names = line.strip()
    names = re.split(r"\s{2,}", names)[0]  # the names column ends where the description starts
    for name in names.replace(",", " ").split():
      layers[name.rstrip("/")] = current
  return layers


def _modules() -> dict[str, str]:
  """Dotted module name -> path, for kvjax/ and pallas_kernels/."""
  found = {}
  for package in ("kvjax", "pallas_kernels"):
    for directory, _, files in os.walk(os.path.join(ROOT, package)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(directory, f), ROOT)[:-3].replace(os.sep, ".")
          found[rel.removesuffix(".__init__")] = os.path.join(directory, f)
  return found


def _imports(path: str) -> set[str]:
  """Absolute kvjax / pallas_kernels modules a file imports (lazy imports included)."""
  tree = ast.parse(open(path).read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
      out |= {f"{node.module}.{a.name}" for a in node.names}
  return {m for m in out if m.split(".")[0] in ("kvjax", "pallas_kernels")}


def _layer_of(module: str, layers: dict[str, int]):
  """kvjax.caches.paged -> the layer of 'caches'; kvjax.steps -> of 'steps'."""
  parts = module.split(".")[1:]
  for n in range(len(parts), 0, -1):
    key = "/".join(parts[:n])
    if key in layers:
      return layers[key]
  return None


MODULES = _modules()
LAYERS = _layers()


def _resolve(name: str) -> str:
  """An imported name -> the module that defines it (kvjax.caches.PagedKVCache -> kvjax.caches)."""
  while name not in MODULES and "." in name:
    name = name.rsplit(".", 1)[0]
  return name


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("kvjax.")))
def test_imports_only_go_down(module):
  if module == "kvjax":
    return  # the package's public surface re-exports every layer
  own = _layer_of(module, LAYERS)
  assert own is not None, f"{module} has no layer in kvjax/__init__.py's table"
  for imported in {_resolve(m) for m in _imports(MODULES[module])}:
    if imported.startswith("pallas_kernels") or imported == "kvjax" or imported == module:
      continue
    if imported.startswith(module + "."):
      continue  # a package's __init__ gathers its own modules
    theirs = _layer_of(imported, LAYERS)
    assert theirs is not None and theirs <= own, (
        f"{module} (layer {own}) imports {imported} (layer {theirs})")


def test_no_import_cycle():
  graph = {m: {_resolve(i) for i in _imports(p)} - {m} for m, p in MODULES.items()}
  graph = {m: {i for i in deps if i in MODULES and not i.startswith(m + ".") and i != "kvjax"}
           for m, deps in graph.items()}
  state = {}

  def visit(m, path):
    if state.get(m) == "done":
      return
    assert state.get(m) != "active", f"import cycle: {' -> '.join(path + [m])}"
    state[m] = "active"
    for dep in sorted(graph[m]):
      visit(dep, path + [m])
    state[m] = "done"

  for m in sorted(graph):
    visit(m, [])


def test_pallas_kernels_stand_alone():
  for module, path in MODULES.items():
    if module.startswith("pallas_kernels"):
      assert not {m for m in _imports(path) if m.startswith("kvjax")}, module


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module):
  with open(MODULES[module]) as f:
    assert sum(1 for _ in f) <= MAX_LINES, module


def test_the_check_sees_an_upward_import():
  # The layer table really orders things: the engine is above the caches, not below.
  assert _layer_of("kvjax.caches.paged", LAYERS) < _layer_of("kvjax.engine", LAYERS)
  assert _layer_of("kvjax.step_batch", LAYERS) < _layer_of("kvjax.caches.kivi", LAYERS)
