"""The package's shape: imports only go down the layers written in kvjax/__init__.py,
no import cycle, pallas_kernels never imports kvjax, and no module over 500 lines.
Each check is a function of a source tree, run on this one and on temp copies with a
planted fault, which it must report."""
from __future__ import annotations

import ast
import os
import re
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 500
MAX_COLUMNS = 100  # the codebase wraps at ~96
PACKAGES = ("kvjax", "pallas_kernels")
# The table's rows: "  9  api, weights/, ...   description" starts a layer, a line indented
# 5 continues its names column, a deeper one continues only the description.
_NAMES_INDENT = 5


def layers_of(root: str) -> dict[str, int]:
  """Module (or package, as 'caches') -> layer, parsed from kvjax/__init__.py's table."""
  with open(os.path.join(root, "kvjax", "__init__.py")) as f:
    doc = ast.get_docstring(ast.parse(f.read()))
  layers, current = {}, None
  table = doc.split("Layers", 1)[1].split("Shapes", 1)[0]
  for line in table.splitlines()[1:]:
    indent = len(line) - len(line.lstrip())
    if not line.strip() or indent > _NAMES_INDENT:
      continue
    cells = line.split(None, 1)
    if cells[0].isdigit():
      current, line = int(cells[0]), cells[1]
    names = re.split(r"\s{2,}", line.strip())[0]  # the names column ends at a wide gap
    for name in names.replace(",", " ").split():
      layers[name.rstrip("/")] = current
  return layers


def modules_of(root: str) -> dict[str, str]:
  """Dotted module name -> path, for kvjax/ and pallas_kernels/."""
  found = {}
  for package in PACKAGES:
    for directory, _, files in os.walk(os.path.join(root, package)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(directory, f), root)[:-3].replace(os.sep, ".")
          found[rel.removesuffix(".__init__")] = os.path.join(directory, f)
  return found


def _imports(path: str) -> set[str]:
  """Absolute kvjax / pallas_kernels modules a file imports (lazy imports included)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
      out |= {f"{node.module}.{a.name}" for a in node.names}
  return {m for m in out if m.split(".")[0] in PACKAGES}


def _layer_of(module: str, layers: dict[str, int]):
  """kvjax.caches.paged -> the layer of 'caches'; kvjax.runtime.steps -> of 'steps'."""
  parts = module.split(".")[1:]
  for n in range(len(parts), 0, -1):
    key = "/".join(parts[:n])
    if key in layers:
      return layers[key]
  return None


def _resolve(name: str, modules) -> str:
  """An imported name -> the module that defines it (kvjax.caches.PagedKVCache -> kvjax.caches)."""
  while name not in modules and "." in name:
    name = name.rsplit(".", 1)[0]
  return name


def table_names_not_modules(root: str) -> list[str]:
  """Names in the layer table that are no module or package (prose read as names)."""
  known = set()
  for module in modules_of(root):
    parts = module.split(".")[1:]
    known |= {"/".join(parts[:n]) for n in range(1, len(parts) + 1)}  # modules and packages
  return sorted(n for n in layers_of(root) if n not in known)


def namespaces(modules: dict[str, str]) -> set[str]:
  """Packages whose __init__ imports nothing of kvjax (a docstring: importing one runs
  nothing, so `from kvjax.engine import config` imports config alone)."""
  return {m for m, path in modules.items()
          if path.endswith("__init__.py") and not _imports(path)}


def upward_imports(root: str) -> list[str]:
  """'importer (layer a) imports imported (layer b)' for every import that goes up, and
  'module has no layer' for a module the table misses."""
  modules, layers, found = modules_of(root), layers_of(root), []
  skip = namespaces(modules)
  for module in sorted(m for m in modules if m.startswith("kvjax.") and m not in skip):
    own = _layer_of(module, layers)
    if own is None:
      found.append(f"{module} has no layer")
      continue
    for imported in sorted({_resolve(m, modules) for m in _imports(modules[module])}):
      if imported.startswith("pallas_kernels") or imported in ("kvjax", module):
        continue
      if imported in skip:
        continue
      if imported.startswith(module + "."):
        continue  # a package's __init__ gathers its own modules
      theirs = _layer_of(imported, layers)
      if theirs is None or theirs > own:
        found.append(f"{module} (layer {own}) imports {imported} (layer {theirs})")
  return found


def import_cycle(root: str):
  """One import cycle as a list of modules, or None."""
  modules = modules_of(root)
  graph = {m: {_resolve(i, modules) for i in _imports(p)} - {m} for m, p in modules.items()}
  graph = {m: sorted(i for i in deps if i in modules and not i.startswith(m + ".") and i != "kvjax")
           for m, deps in graph.items()}
  state = {}

  def visit(m, path):
    if state.get(m) == "done":
      return None
    if state.get(m) == "active":
      return path[path.index(m):] + [m]
    state[m] = "active"
    for dep in graph[m]:
      cycle = visit(dep, path + [m])
      if cycle:
        return cycle
    state[m] = "done"
    return None

  for m in sorted(graph):
    cycle = visit(m, [])
    if cycle:
      return cycle
  return None


def kernels_importing_kvjax(root: str) -> list[str]:
  return sorted(m for m, p in modules_of(root).items() if m.startswith("pallas_kernels")
                and any(i.startswith("kvjax") for i in _imports(p)))


def oversized(root: str) -> list[str]:
  out = []
  for module, path in sorted(modules_of(root).items()):
    with open(path) as f:
      if sum(1 for _ in f) > MAX_LINES:
        out.append(module)
  return out


def wide_lines(root: str) -> list[str]:
  """module:line of every line wider than MAX_COLUMNS (wrap, never join to fit)."""
  out = []
  for module, path in sorted(modules_of(root).items()):
    with open(path) as f:
      out += [f"{module}:{i}" for i, line in enumerate(f, 1)
              if len(line.rstrip("\n")) > MAX_COLUMNS]
  return out


def test_imports_only_go_down():
  assert upward_imports(ROOT) == []


def test_the_table_names_only_modules():
  assert table_names_not_modules(ROOT) == []


def test_no_import_cycle():
  assert import_cycle(ROOT) is None


def test_pallas_kernels_stand_alone():
  assert kernels_importing_kvjax(ROOT) == []


def test_modules_stay_small():
  assert oversized(ROOT) == []


def test_lines_stay_within_the_width():
  assert wide_lines(ROOT) == []


# -- each check reports a fault planted in a temp copy of the tree --------------------------

@pytest.fixture
def tree(tmp_path):
  for package in PACKAGES:
    shutil.copytree(os.path.join(ROOT, package), tmp_path / package,
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))
  return tmp_path


def _append(path, text):
  with open(path, "a") as f:
    f.write(text)


def test_a_planted_upward_import_is_caught(tree):
  late = "\ndef _late():\n  from kvjax.engine import engine\n"
  _append(tree / "kvjax" / "caches" / "paged.py", late)
  _append(tree / "kvjax" / "runtime" / "step_batch.py", "\nimport kvjax.server.app\n")
  assert upward_imports(str(tree)) == [
      "kvjax.caches.paged (layer 3) imports kvjax.engine.engine (layer 8)",
      "kvjax.runtime.step_batch (layer 1) imports kvjax.server.app (layer 10)"]


def test_a_module_missing_from_the_table_is_caught(tree):
  (tree / "kvjax" / "fresh_module.py").write_text("X = 1\n")
  assert upward_imports(str(tree)) == ["kvjax.fresh_module has no layer"]


def test_prose_in_the_table_is_not_read_as_names(tree):
  init = tree / "kvjax" / "__init__.py"
  text = init.read_text()
  # A names-column typo is caught; the description column's words never are names.
  init.write_text(text.replace("model/decoder, model/hybrid,", "model/decoder, model/hybrdi,"))
  assert table_names_not_modules(str(tree)) == ["model/hybrdi"]
  assert "kvjax.model.hybrid has no layer" in upward_imports(str(tree))
  assert {"records", "(+", "pallas_kernels)", "the", "KV"}.isdisjoint(layers_of(ROOT))


def test_a_planted_cycle_is_caught(tree):
  _append(tree / "kvjax" / "engine" / "sched" / "pages.py", "\nfrom kvjax.model import config\n")
  _append(tree / "kvjax" / "model" / "config.py", "\nfrom kvjax.engine.sched import pages\n")
  cycle = import_cycle(str(tree))
  assert cycle is not None and set(cycle) == {"kvjax.engine.sched.pages", "kvjax.model.config"}


def test_a_kernel_importing_kvjax_and_a_long_module_are_caught(tree):
  kernel = sorted(m for m in modules_of(str(tree)) if m.startswith("pallas_kernels."))[0]
  _append(modules_of(str(tree))[kernel], "\nimport kvjax.model.config\n")
  assert kernels_importing_kvjax(str(tree)) == [kernel]
  _append(tree / "kvjax" / "engine" / "sched" / "pages.py", "\n" * MAX_LINES)
  assert oversized(str(tree)) == ["kvjax.engine.sched.pages"]
  _append(tree / "kvjax" / "model" / "layers.py", "\n# " + "x" * MAX_COLUMNS + "\n")
  layers = tree / "kvjax" / "model" / "layers.py"
  assert wide_lines(str(tree)) == [f"kvjax.model.layers:{sum(1 for _ in open(layers))}"]
