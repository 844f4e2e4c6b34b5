"""Run an untrusted Python program contained, for the HumanEval checks.

Where bubblewrap works (Debian's `bubblewrap` package) the program runs in fresh pid, net,
ipc and uts namespaces and a new session, dying with the harness: its filesystem is an empty
root with read-only binds of what the interpreter needs (/usr, the loader's links, the
interpreter's prefix) and a size-capped tmpfs scratch dir (SCRATCH, its cwd) as the only
writable place, so it reads no $HOME, writes nothing outside, and reaches no host socket;
when its first process exits or is killed the namespace's init exits and the kernel kills
every descendant (setsid and double forks included).  Where bwrap is missing or cannot make
namespaces, the program runs under the limits alone, in a fresh temporary directory, with a
warning naming what is then not contained (NOT_CONTAINED).
In both, a prelude run before the program's code sets the rlimits (soft = hard, so the code
cannot raise them: address space, CPU seconds, file size, open files, processes), in
bwrap makes root a fresh random user (root is exempt from RLIMIT_NPROC; outside bwrap the
user could not read an interpreter under /root) and disables the socket module's
connections.  The harness reads stdout and stderr in bounded chunks, keeps only their
last TAIL_BYTES, and kills the run once it has written `output_bytes` or run `timeout_s`
wall-clock seconds.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Optional

__all__ = ["SCRATCH", "TAIL_BYTES", "NOT_CONTAINED", "Finished", "bwrap_problem", "run_python"]

SCRATCH = "/sandbox"
SCRATCH_BYTES = 16 << 20
TAIL_BYTES = 64 << 10
NOT_CONTAINED = ("file writes and reads outside the scratch dir ($HOME included), network "
                 "(only the socket module is patched), processes that call setsid (they "
                 "outlive the check), and, run as root, the process count (root is exempt "
                 "from RLIMIT_NPROC)")
_CHUNK = 64 << 10
_DRAIN_S = 0.2  # rlimits only: how long to read after exit (a setsid'd child holds the pipes)
_LOADER_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

_PRELUDE = """\
import os as _os, resource as _resource
for _limit, _value in (("RLIMIT_AS", {memory_bytes}), ("RLIMIT_CPU", {cpu_seconds}),
                       ("RLIMIT_FSIZE", 1 << 20), ("RLIMIT_NOFILE", 64),
                       ("RLIMIT_NPROC", {max_processes})):
  _resource.setrlimit(getattr(_resource, _limit), (_value, _value))
if {drop_root} and _os.getuid() == 0:
  _os.setgroups([])
  _os.setresgid({uid}, {uid}, {uid})
  _os.setresuid({uid}, {uid}, {uid})
import socket as _socket
def _refuse(*args, **kwargs):
  raise OSError("network access is disabled in the HumanEval sandbox")
_socket.socket = _refuse
_socket.create_connection = _refuse
_socket.getaddrinfo = _refuse
del _os, _resource, _limit, _value, _socket, _refuse
"""


@dataclasses.dataclass(frozen=True)
class Finished:
  """How a run ended: its exit status (None when the harness killed it, and why in
  `killed`), the last TAIL_BYTES of its stdout and stderr, and what contained it
  ("bwrap" or "rlimits")."""
  returncode: Optional[int]
  stdout: bytes
  stderr: bytes
  killed: Optional[str]
  sandbox: str


def _interpreter() -> str:
  return os.path.realpath(sys.executable)


def _bwrap_command(bwrap: str, program: Optional[str]) -> list[str]:
  """bwrap's argument list, up to the interpreter (`program`: a host file to run)."""
  args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
          "--unshare-cgroup-try", "--new-session", "--die-with-parent"]
  if os.getuid() == 0:  # no user namespace: the prelude turns root into a fresh user
    args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
  else:
    args += ["--unshare-user"]
  args += ["--tmpfs", "/", "--ro-bind", "/usr", "/usr"]
  for name in _LOADER_LINKS:
    path = "/" + name
    if os.path.islink(path):
      args += ["--symlink", os.readlink(path), path]
    elif os.path.isdir(path):
      args += ["--ro-bind", path, path]
  for root in sorted({os.path.realpath(sys.base_prefix), os.path.dirname(_interpreter())}):
    if root == "/usr" or root.startswith("/usr/"):
      continue
    parents = root.split("/")[1:-1]  # bwrap makes missing parents 0700: the user needs x
    for i in range(len(parents)):
      args += ["--perms", "0755", "--dir", "/" + "/".join(parents[:i + 1])]
    args += ["--ro-bind", root, root]
  args += ["--proc", "/proc", "--dev", "/dev", "--perms", "01777", "--size",
           str(SCRATCH_BYTES), "--tmpfs", SCRATCH, "--chdir", SCRATCH]
  if program is not None:
    args += ["--ro-bind", program, f"{SCRATCH}/check.py"]
  return args + ["--"]


@functools.cache
def bwrap_problem(bwrap: str = "bwrap") -> Optional[str]:
  """None when `bwrap` (a name on PATH or a path) contains a program here, else why not."""
  path = shutil.which(bwrap)
  if path is None:
    return f"{bwrap!r} not found (Debian: apt-get install bubblewrap)"
  try:
    probe = subprocess.run(_bwrap_command(path, None) + [_interpreter(), "-I", "-S", "-c", ""],
                           env={}, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"{path} failed: {e}"
  if probe.returncode != 0:
    lines = probe.stderr.decode("utf-8", "replace").strip().splitlines()
    return f"{path} failed: {lines[-1] if lines else probe.returncode}"
  return None


def _exited(pid: int) -> bool:
  """Whether `pid` (our child) has exited, leaving it unreaped so its group id stays ours."""
  return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _read_bounded(child: subprocess.Popen, timeout_s: float, output_bytes: int,
                  drain_s: Optional[float]) -> tuple[dict, Optional[str]]:
  """Read the child's stdout and stderr until both close (or, with `drain_s`, that long
  after it exits) and it exits -> (their last TAIL_BYTES by stream, why it must be
  killed or None)."""
  deadline = time.monotonic() + timeout_s
  timed_out = f"timed out after {timeout_s} s"
  tails = {child.stdout: bytearray(), child.stderr: bytearray()}
  with selectors.DefaultSelector() as selector:
    for stream in tails:
      selector.register(stream, selectors.EVENT_READ)
    total, exited_at = 0, None
    while selector.get_map():
      now = time.monotonic()
      if now >= deadline:
        return tails, timed_out
      if drain_s is not None and exited_at is None and _exited(child.pid):
        exited_at = now
      if exited_at is not None and now - exited_at > drain_s:
        break
      for key, _ in selector.select(min(deadline - now, 0.05)):
        chunk = os.read(key.fd, _CHUNK)
        if not chunk:
          selector.unregister(key.fileobj)
          continue
        total += len(chunk)
        tail = tails[key.fileobj]
        tail += chunk
        del tail[:-TAIL_BYTES]
        if total > output_bytes:
          return tails, f"output over {output_bytes} bytes"
  while not _exited(child.pid):  # the pipes closed: bwrap is reporting the exit status
    if time.monotonic() >= deadline:
      return tails, timed_out
    time.sleep(0.005)
  return tails, None


def run_python(program: str, *, stdin: bytes = b"", timeout_s: float = 10.0,
               memory_bytes: int = 1 << 30, max_processes: int = 32,
               output_bytes: int = 1 << 20, bwrap: str = "bwrap") -> Finished:
  """Run `program` (module doc) with `stdin` as its input -> Finished."""
  problem = bwrap_problem(bwrap)
  if problem is not None:
    warnings.warn(f"HumanEval sandbox: {problem}; running with rlimits only, so these are "
                  f"not contained: {NOT_CONTAINED}", RuntimeWarning, stacklevel=2)
  prelude = _PRELUDE.format(memory_bytes=memory_bytes, cpu_seconds=int(timeout_s) + 1,
                            max_processes=max_processes, drop_root=problem is None,
                            uid=(1 << 24) + secrets.randbelow(1 << 24))
  with tempfile.TemporaryDirectory() as workdir:
    path = os.path.join(workdir, "check.py")
    with open(path, "w") as f:
      f.write(prelude + program)
    os.chmod(path, 0o644)  # for tracebacks, read once the prelude made root a fresh user
    if problem is None:
      command = _bwrap_command(shutil.which(bwrap), path) + [_interpreter(), "-I",
                                                             f"{SCRATCH}/check.py"]
    else:
      command = [_interpreter(), "-I", path]
    child = subprocess.Popen(command, cwd=workdir, env={}, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    try:
      try:
        child.stdin.write(stdin)
        child.stdin.close()
      except BrokenPipeError:  # it exited without reading its input
        pass
      tails, killed = _read_bounded(child, timeout_s, output_bytes,
                                    None if problem is None else _DRAIN_S)
    finally:
      try:  # the whole group; in bwrap its namespace's init dies with it, and all inside
        os.killpg(child.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      child.wait()
      child.stdout.close()
      child.stderr.close()
  return Finished(returncode=None if killed else child.returncode,
                  stdout=bytes(tails[child.stdout]), stderr=bytes(tails[child.stderr]),
                  killed=killed, sandbox="rlimits" if problem else "bwrap")
