"""kvjax.eval.sandbox through HumanEval's check: each escape issue 53 found is contained,
judged on the host (the file is absent, the listener got no connection, no process is
left, the harness's own allocations stay small), and only the tests' own report is a
pass.  Each completion tries its escape and returns what it got; the problem's check
asserts the escape failed, so "passed" also shows the code ran."""
from __future__ import annotations

import os
import pathlib
import secrets
import socket
import textwrap
import time
import tracemalloc

import pytest

from kvjax.eval import humaneval, sandbox


def _problem(expected: str) -> dict:
  """A one-function problem whose tests assert f() == expected."""
  return dict(task_id="escape", prompt="def f():\n", entry_point="f",
              test=f"def check(c):\n  got = c()\n  assert got == {expected!r}, got\n")


def _check(body: str, expected: str, **limits) -> dict:
  return humaneval.check_completion(_problem(expected), textwrap.indent(body, "    "),
                                    **limits)


def _processes_with(marker: str) -> list[int]:
  """Host pids whose command line holds `marker`."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          found.append(int(pid))
    except OSError:  # exited meanwhile
      pass
  return found


def test_writes_outside_the_scratch_dir_fail(tmp_path):
  outside = tmp_path / "escaped"
  beside_stdlib = pathlib.Path(os.path.dirname(os.__file__)) / f"escaped-{secrets.token_hex(4)}"
  body = f"""\
import os
written = []
for path in ({str(outside)!r}, {str(beside_stdlib)!r}, "scratch"):
  try:
    with open(path, "w") as f:
      f.write("x")
    written.append(os.path.basename(path))
  except OSError:
    pass
return ",".join(written)
"""
  try:
    out = _check(body, "scratch")  # only the scratch dir (its cwd) takes a write
    assert out["passed"], out
    assert not outside.exists() and not beside_stdlib.exists()
  finally:
    beside_stdlib.unlink(missing_ok=True)


def test_home_is_not_readable():
  secret = pathlib.Path.home() / f".kvjax-sandbox-{secrets.token_hex(4)}"
  secret.write_text("secret")
  try:
    body = f"""\
try:
  return open({str(secret)!r}).read()
except OSError:
  return "unreadable"
"""
    out = _check(body, "unreadable")
    assert out["passed"], out
  finally:
    secret.unlink()


_CONNECT = {
    "_socket": """\
import _socket
s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
s.connect(("127.0.0.1", {port}))
""",
    "reloaded socket": """\
import importlib, socket
importlib.reload(socket)
socket.create_connection(("127.0.0.1", {port}), timeout=2)
""",
}


@pytest.mark.parametrize("way", sorted(_CONNECT))
def test_no_connection_to_a_host_listener(way):
  with socket.create_server(("127.0.0.1", 0)) as listener:
    port = listener.getsockname()[1]
    body = "try:\n" + textwrap.indent(_CONNECT[way].format(port=port), "  ") + """\
  return "connected"
except OSError:
  return "refused"
"""
    out = _check(body, "refused")
    assert out["passed"], out
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing is waiting to be accepted
      listener.accept()


def test_no_connection_from_a_subprocess():
  with socket.create_server(("127.0.0.1", 0)) as listener:
    port = listener.getsockname()[1]
    child = ("import socket\ntry:\n  socket.create_connection(('127.0.0.1', %d), timeout=2)\n"
             "  print('connected')\nexcept OSError:\n  print('refused')\n" % port)
    body = f"""\
import subprocess, sys
run = subprocess.run([sys.executable, "-c", {child!r}], capture_output=True, text=True)
return run.stdout.strip()
"""
    out = _check(body, "refused")  # "refused" also shows the subprocess ran
    assert out["passed"], out
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
      listener.accept()


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)"])
def test_an_early_exit_0_is_not_a_pass(exit_call):
  problem = humaneval.load_problems(1)[0]
  out = humaneval.check_completion(problem, textwrap.indent(exit_call, "    ") + "\n")
  assert not out["passed"] and out["result"] == "failed: exited 0 before the tests reported"
  assert humaneval.check_completion(problem, problem["canonical_solution"])["passed"]


def _daemon(marker: str) -> str:
  """A body that leaves a setsid'd grandchild sleeping 6 s (its command line holds
  `marker`) holding the check's stdout and stderr."""
  return f"""\
import os, sys
if os.fork() == 0:
  os.setsid()
  if os.fork() == 0:
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(6)", {marker!r}])
  os._exit(0)
os.wait()
"""


@pytest.mark.parametrize("then", ["return 'done'", "while True:\n  pass"])
def test_a_setsid_double_fork_dies_with_the_check(then):
  """Whether the check returns or times out, it returns at once (within the 2 s limit)
  and the daemon is gone."""
  marker = f"kvjax-daemon-{secrets.token_hex(4)}"
  out = _check(_daemon(marker) + then + "\n", "done", timeout_s=2.0)
  if then.startswith("return"):
    assert out["passed"], out
  else:
    assert out["result"] == "timed out after 2.0 s"
  assert out["seconds"] < 3.5
  time.sleep(0.2)  # SIGKILL is delivered asynchronously
  assert _processes_with(marker) == []


def test_forks_are_bounded():
  """300 forks (each child sleeps 2 s): fewer than the process limit succeed."""
  body = """\
import os, time
forks = 0
try:
  while forks < 300:
    if os.fork() == 0:
      time.sleep(2)
      os._exit(0)
    forks += 1
except OSError:
  pass
return "bounded" if forks < 32 else f"{forks} forks"
"""
  out = _check(body, "bounded")
  assert out["passed"], out


def test_300_mb_of_stderr_is_not_buffered():
  body = """\
import sys
block = "x" * (1 << 20)
for _ in range(300):
  sys.stderr.write(block)
return "written"
"""
  tracemalloc.start()
  try:
    start = time.perf_counter()
    out = _check(body, "written")
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert not out["passed"] and out["result"].startswith("output over")
  assert peak < 8 << 20, peak
  assert seconds < 5


def test_without_bwrap_it_warns_naming_what_is_not_contained():
  problem = humaneval.load_problems(1)[0]
  with pytest.warns(RuntimeWarning, match="not contained: file writes"):
    out = humaneval.check_program(problem, problem["prompt"] + problem["canonical_solution"],
                                  bwrap="/nonexistent/bwrap")
  assert out["passed"] and out["sandbox"] == "rlimits"
  contained = humaneval.check_completion(problem, problem["canonical_solution"])
  assert contained["sandbox"] == "bwrap"  # bwrap works here (.ci/run installs it)
  assert sandbox.bwrap_problem("/nonexistent/bwrap").startswith("'/nonexistent/bwrap' not")
