"""Results computed once per test run, shared by every pytest-xdist worker."""
from __future__ import annotations

import json
from typing import Callable

from filelock import FileLock


def once_per_run(tmp_path_factory, name: str, compute: Callable[[], object]):
  """compute()'s JSON result, computed by the first worker to ask and read from disk by
  the others (a module fixture runs once per worker that gets one of its tests: the
  sharded checks' subprocess alone costs minutes of the 2 CI cores)."""
  root = tmp_path_factory.getbasetemp()
  if root.name.startswith("popen-gw"):  # an xdist worker's: the run's shared parent
    root = root.parent
  path = root / f"{name}.json"
  with FileLock(str(path) + ".lock"):
    if not path.exists():
      path.write_text(json.dumps(compute()))
  return json.loads(path.read_text())
