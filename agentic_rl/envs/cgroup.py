"""A memory cgroup per sandbox: one bound on everything its processes hold.

RLIMIT_AS bounds each process's address space. It does not add the processes up,
and it does not see pages held outside a mapping: a memfd written and closed over,
pipe buffers, SysV shm, tmpfs. A memory cgroup does: every page the sandbox's
processes charge counts against `sandbox.total_memory_mb`, and at the limit the
kernel kills inside the cgroup, never the host.

cgroup v1 (the memory controller's own hierarchy) and v2 (where our cgroup may
give the memory controller to children) are both handled. Where neither is
writable (not root, no delegation) there is no cgroup, and the sandbox's probe
says so among the guarantees it cannot give. Where the host has one but a sandbox's own
cannot be made, `create` raises, and the sandbox fails to start unless
`sandbox.memory_cgroup="best_effort"` (sandbox.Sandbox).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import time
import uuid

log = logging.getLogger(__name__)

_V1_ROOT = "/sys/fs/cgroup/memory"
_V2_ROOT = "/sys/fs/cgroup"
_PREFIX = "agentic_rl_sb_"


def _own_path(version: int) -> str | None:
  """This process's cgroup path in the v1 memory hierarchy or the v2 unified one."""
  try:
    with open("/proc/self/cgroup") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in lines:
    parts = line.split(":", 2)
    if len(parts) != 3:
      continue
    hid, controllers, path = parts
    if version == 1 and "memory" in controllers.split(","):
      return path
    if version == 2 and hid == "0" and controllers == "":
      return path
  return None


def _write(path: str, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)


@functools.lru_cache(maxsize=None)
def parent() -> tuple[int, str] | None:
  """(version, directory) under which sandbox cgroups are made, or None if none can be."""
  v1 = _own_path(1)
  if v1 is not None and os.path.isdir(_V1_ROOT):
    base = os.path.join(_V1_ROOT, v1.lstrip("/"))
    if os.path.isfile(os.path.join(base, "memory.limit_in_bytes")) and os.access(base, os.W_OK):
      _remove_stale(base)
      return 1, base
  v2 = _own_path(2)
  if v2 is not None and os.path.isfile(os.path.join(_V2_ROOT, "cgroup.controllers")):
    base = os.path.join(_V2_ROOT, v2.lstrip("/"))
    control = os.path.join(base, "cgroup.subtree_control")
    try:
      with open(control) as f:
        enabled = f.read().split()
      if "memory" not in enabled:
        _write(control, "+memory")  # Refused while our cgroup holds processes itself.
      _remove_stale(base)
      return 2, base
    except OSError:
      pass
  return None


def _remove_stale(base: str) -> None:
  """Empty cgroups of processes that died without removing theirs."""
  try:
    names = os.listdir(base)
  except OSError:
    return
  for name in names:
    m = re.fullmatch(_PREFIX + r"(\d+)_\w+", name)
    if not m or int(m.group(1)) == os.getpid():
      continue
    try:
      os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
      try:
        os.rmdir(os.path.join(base, name))
      except OSError:
        pass
    except PermissionError:
      pass


class MemoryCgroup:
  """One sandbox's cgroup; `join_command` puts a command in it before it starts."""

  def __init__(self, version: int, path: str, limit_bytes: int):
    self.version, self.path, self.limit_bytes = version, path, limit_bytes

  @classmethod
  def create(cls, limit_bytes: int) -> MemoryCgroup | None:
    """A new cgroup bounded at limit_bytes; None where this host makes none (parent() is
    None). OSError, saying why, where it does but this one cannot be made: the caller
    decides whether a sandbox may run without the bound the others have."""
    where = parent()
    if where is None:
      return None
    version, base = where
    path = os.path.join(base, f"{_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}")
    try:
      os.mkdir(path)
    except OSError as e:
      raise OSError(e.errno, f"could not create a memory cgroup under {base}: "
                             f"{e.strerror or e}") from e
    try:
      if version == 1:
        _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
        memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # No swapping past the limit either.
          _write(memsw, str(limit_bytes))
      else:
        _write(os.path.join(path, "memory.max"), str(limit_bytes))
        swap = os.path.join(path, "memory.swap.max")
        if os.path.exists(swap):
          _write(swap, "0")
    except OSError as e:
      _rmdir(path)
      raise OSError(e.errno, f"could not set the memory limit of {path}: "
                             f"{e.strerror or e}") from e
    return cls(version, path, limit_bytes)

  @property
  def procs_file(self) -> str:
    return os.path.join(self.path, "cgroup.procs")

  def join_command(self, cmd: list[str]) -> list[str]:
    """`cmd`, started from a shell that first moves itself into this cgroup, so that
    every process the command ever forks is charged here (no race with its forks)."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', self.procs_file] + cmd

  def oom_kills(self) -> int:
    """How many processes the kernel has killed here for the memory limit."""
    name = "memory.oom_control" if self.version == 1 else "memory.events"
    try:
      with open(os.path.join(self.path, name)) as f:
        for line in f:
          key, _, value = line.partition(" ")
          if key == "oom_kill":
            return int(value)
    except (OSError, ValueError):
      pass
    return 0

  def close(self) -> None:
    """Kills whatever is left in the cgroup and removes it; never raises."""
    for _ in range(200):
      if _rmdir(self.path):
        return
      try:
        with open(self.procs_file) as f:
          pids = [int(x) for x in f.read().split()]
      except (OSError, ValueError):
        pids = []
      for pid in pids:
        try:
          os.kill(pid, signal.SIGKILL)
        except OSError:
          pass
      time.sleep(0.005)
    log.error("memory cgroup %s could not be removed", self.path)


def _rmdir(path: str) -> bool:
  try:
    os.rmdir(path)
    return True
  except FileNotFoundError:
    return True
  except OSError:
    return False
