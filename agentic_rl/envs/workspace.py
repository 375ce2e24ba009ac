"""A per-episode workspace directory and the only file access the host does in it.

Every path an agent names goes through `Workspace.resolve`: absolute paths,
`..` components, characters outside [A-Za-z0-9_./-] and symlinks that lead out
of the workspace are refused with `PathRefused`, whose message is shown to the
agent. Reads and writes open the resolved path with O_NOFOLLOW and accept
regular files only (a FIFO planted by sandboxed code cannot block the host).
No sandboxed process runs while the host touches the workspace: every command's
process tree is killed before its tool call returns.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import tempfile
import threading
import uuid

_SAFE_PATH_RE = re.compile(r"[A-Za-z0-9_./-]+")
_SKIP_DIRS = ("__pycache__",)

_parent_lock = threading.Lock()
_parents: dict[str, str] = {}


class PathRefused(ValueError):
  """A path outside the workspace, or otherwise not allowed; the message is for the agent."""


class FileToolError(ValueError):
  """A file operation that failed for an ordinary reason (missing, too large, not text)."""


def _workspace_parent(root: str) -> str:
  """One private parent per process and root: mode 0711, traversable but not listable."""
  base = root or tempfile.gettempdir()
  with _parent_lock:
    if base not in _parents:
      os.makedirs(base, exist_ok=True)
      _remove_orphaned_parents(base)
      parent = tempfile.mkdtemp(prefix=f"agentic_rl_ws_{os.getpid()}_", dir=base)
      os.chmod(parent, 0o711)
      _parents[base] = parent
      atexit.register(_rmtree, parent)
    return _parents[base]


def _remove_orphaned_parents(base: str) -> None:
  """Workspaces of processes that died without their atexit cleanup (SIGKILL, OOM)."""
  for name in os.listdir(base):
    m = re.fullmatch(r"agentic_rl_ws_(\d+)_\w+", name)
    if not m or int(m.group(1)) == os.getpid():
      continue
    try:
      os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
      _rmtree(os.path.join(base, name))
    except PermissionError:
      pass  # Alive, and someone else's.


def _rmtree(path: str) -> None:
  def make_writable_and_retry(func, p, _exc):
    try:
      os.chmod(os.path.dirname(p), 0o700)
      if not os.path.islink(p) and os.path.isdir(p):
        os.chmod(p, 0o700)
      func(p)
    except OSError:
      pass
  if os.path.lexists(path):
    shutil.rmtree(path, onerror=make_writable_and_retry)


class Workspace:
  """A fresh directory owned by `owner_uid` (the sandbox's uid), removed by `close()`."""

  def __init__(self, root: str = "", owner_uid: int | None = None):
    self._owner = owner_uid
    self.path = os.path.join(_workspace_parent(root), f"ep-{uuid.uuid4().hex[:16]}")
    os.mkdir(self.path, 0o700)
    self._real = os.path.realpath(self.path)
    self._chown(self.path)
    self.closed = False

  def _chown(self, path: str) -> None:
    if self._owner is not None:
      os.chown(path, self._owner, self._owner, follow_symlinks=False)

  def close(self) -> None:
    if not self.closed:
      self.closed = True
      _rmtree(self.path)

  def resolve(self, rel: str, follow_final: bool = True) -> str:
    """The host path of `rel` (its real path unless follow_final=False), or PathRefused."""
    if not isinstance(rel, str) or not rel:
      raise PathRefused("empty path")
    shown = rel if len(rel) <= 60 else rel[:60] + "..."
    if rel.startswith("/"):
      raise PathRefused(f"refused {shown!r}: absolute paths are not allowed; use a path "
                        "relative to the workspace")
    if not _SAFE_PATH_RE.fullmatch(rel):
      raise PathRefused(f"refused {shown!r}: paths may only use letters, digits and _ . / -")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
      raise PathRefused(f"refused {shown!r}: '..' is not allowed (it leaves the workspace)")
    if not parts:
      raise PathRefused(f"refused {shown!r}: names the workspace itself, not a file")
    parent = os.path.realpath(os.path.join(self._real, *parts[:-1]))
    if not self._inside(parent, allow_root=True):
      raise PathRefused(f"refused {shown!r}: a symlink leads outside the workspace")
    lexical = os.path.join(parent, parts[-1])
    if not follow_final:
      return lexical
    real = os.path.realpath(lexical)
    if not self._inside(real, allow_root=False):
      raise PathRefused(f"refused {shown!r}: a symlink leads outside the workspace")
    return real

  def _inside(self, real: str, allow_root: bool) -> bool:
    if real == self._real:
      return allow_root
    return os.path.commonpath([real, self._real]) == self._real

  def relpath(self, real: str) -> str:
    return os.path.relpath(real, self._real)

  def _open_regular(self, real: str, rel: str, flags: int) -> int:
    try:
      fd = os.open(real, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
      raise FileToolError(f"no such file: {rel}") from None
    except IsADirectoryError:
      raise FileToolError(f"{rel} is a directory") from None
    except OSError as e:
      raise FileToolError(f"cannot open {rel}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
      os.close(fd)
      raise FileToolError(f"{rel} is a directory" if stat.S_ISDIR(mode)
                          else f"{rel} is not a regular file")
    return fd

  def read_text(self, rel: str, max_bytes: int) -> str:
    real = self.resolve(rel)
    fd = self._open_regular(real, rel, os.O_RDONLY)
    try:
      size = os.fstat(fd).st_size
      if size > max_bytes:
        raise FileToolError(f"{rel} is {size} bytes, over the {max_bytes}-byte limit")
      data = b""
      while len(data) <= max_bytes:
        chunk = os.read(fd, max_bytes + 1 - len(data))
        if not chunk:
          break
        data += chunk
    finally:
      os.close(fd)
    if len(data) > max_bytes:
      raise FileToolError(f"{rel} is over the {max_bytes}-byte limit")
    return data.decode("utf-8", errors="replace")

  def write_text(self, rel: str, text: str, must_exist: bool = True) -> None:
    """Atomically replaces `rel` (a symlink there is replaced, never followed)."""
    real = self.resolve(rel)
    if os.path.lexists(real):
      st = os.lstat(real)
      if not stat.S_ISREG(st.st_mode):
        raise FileToolError(f"{rel} is not a regular file")
    elif must_exist:
      raise FileToolError(f"no such file: {rel}")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent) or os.path.islink(parent):
      raise FileToolError(f"no such directory for {rel}")
    tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
      os.write(fd, text.encode("utf-8"))
      if self._owner is not None:
        os.fchown(fd, self._owner, self._owner)
    finally:
      os.close(fd)
    os.replace(tmp, real)

  def restore_file(self, rel: str, text: str) -> None:
    """Writes a pristine copy of `rel`, whatever the sandbox left at that name."""
    lexical = self.resolve(rel, follow_final=False)
    if os.path.islink(lexical) or (os.path.lexists(lexical) and not os.path.isfile(lexical)):
      if os.path.isdir(lexical) and not os.path.islink(lexical):
        _rmtree(lexical)
      else:
        os.unlink(lexical)
    self.write_text(rel, text, must_exist=False)

  def write_initial(self, files: dict[str, str]) -> None:
    for rel, text in sorted(files.items()):
      parts = rel.split("/")
      for i in range(1, len(parts)):
        d = os.path.join(self._real, *parts[:i])
        if not os.path.isdir(d):
          os.mkdir(d, 0o755)
          self._chown(d)
      self.write_text(rel, text, must_exist=False)

  def list_files(self, max_entries: int, max_bytes: int) -> tuple[list[str], int]:
    """Lines 'path (N lines)' sorted, and the total count of entries found."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(self._real, followlinks=False):
      dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
      linked_dirs = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
      for name in sorted(filenames + linked_dirs):
        full = os.path.join(dirpath, name)
        rel = os.path.relpath(full, self._real)
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
          entries.append(f"{rel} (symlink)")
        elif not stat.S_ISREG(st.st_mode):
          entries.append(f"{rel} (special file)")
        elif st.st_size > max_bytes:
          entries.append(f"{rel} ({st.st_size} bytes)")
        else:
          try:
            with open(full, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fh:
              data = fh.read()
            n = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
            entries.append(f"{rel} ({n} lines)")
          except OSError:
            entries.append(f"{rel} (unreadable)")
      if len(entries) > max_entries:
        break
    return entries[:max_entries], len(entries)
