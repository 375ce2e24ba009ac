"""A per-episode workspace directory and the only file access the host does in it.

Every path an agent names goes through `Workspace.resolve`: absolute paths,
`..` components, characters outside [A-Za-z0-9_./-] and symlinks that lead out
of the workspace are refused with `PathRefused`, whose message is shown to the
agent. Reads and writes open the resolved path with O_NOFOLLOW and accept
regular files only (a FIFO planted by sandboxed code cannot block the host).
No sandboxed process runs while the host touches the workspace: every command's
process tree is killed before its tool call returns.

The host's own walks over the tree (listing, removal) are iterative over
directory file descriptors: they never recurse on the Python stack, never
follow a symlink, never leave the workspace's filesystem, and listing bounds
its depth, entries and time, so a tree ~1500 deep or 10^5 wide costs the host
nothing but a note. Names are shown escaped (`render_name`), so a name with a
newline or bytes that are not UTF-8 cannot forge a line of an observation.

Run as root, each workspace is its own tmpfs of `quota_bytes` and `max_files`
inodes: the per-episode disk quota, exact whatever the sandbox writes, and a
mount whose source names no host path. Removing it is one detach.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import re
import stat
import tempfile
import threading
import time
import uuid

log = logging.getLogger(__name__)

_SAFE_PATH_RE = re.compile(r"[A-Za-z0-9_./-]+")
_SKIP_DIRS = (b"__pycache__",)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MNT_DETACH = 2
_LIST_MAX_DEPTH = 24  # Listing bounds: deeper directories are summarised, not entered.
_LIST_MAX_VISITED = 4096
_LIST_MAX_SECONDS = 1.0
_libc = None

_parent_lock = threading.Lock()
_parents: dict[str, str] = {}
_warned_no_quota: set = set()


def _warn_no_quota(why: str) -> None:
  if why not in _warned_no_quota:
    _warned_no_quota.add(why)
    log.warning("sandbox workspaces have no per-episode disk quota (%s): only each file is "
                "bounded, by sandbox.file_size_mb", why)


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


def _libc_call(name: str, *args) -> None:
  global _libc
  if _libc is None:
    _libc = ctypes.CDLL(None, use_errno=True)
  if getattr(_libc, name)(*args) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{name}: {os.strerror(err)}")


def _mounts_below(path: str) -> list[str]:
  """Mount points at or below `path` (from /proc/self/mountinfo), deepest first."""
  real = os.path.realpath(path)
  out = []
  try:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
      for line in f:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if point == real or point.startswith(real + "/"):
          out.append(point)
  except OSError:
    pass
  return sorted(out, key=len, reverse=True)


def _rmtree(path: str) -> None:
  """Removes `path`: detaches mounts below it, then deletes iteratively; never raises."""
  try:
    for point in _mounts_below(path):
      _libc_call("umount2", point.encode("utf-8", "surrogateescape"), _MNT_DETACH)
    if os.path.lexists(path):
      remove_tree(path)
  except OSError as e:
    log.error("could not remove %s: %s", path, e)


def _open_dir(name, dir_fd) -> int:
  try:
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
  except PermissionError:  # A host that is not root: make our own directory enterable.
    os.chmod(name, 0o700, dir_fd=dir_fd)
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def remove_tree(path: str) -> None:
  """Deletes `path` and everything below it, iteratively, with O(1) open descriptors.

  Descends by directory fd and climbs back by "..": safe because no sandboxed process
  runs while the host works in the workspace. Symlinks are removed, never followed;
  another filesystem mounted below is left alone (as `rm --one-file-system` does).
  """
  st = os.lstat(path)
  if not stat.S_ISDIR(st.st_mode):
    os.unlink(path)
    return
  dev = st.st_dev
  fd = _open_dir(path, None)
  names: list[str] = []  # The path from `path` down to fd, one name per level.
  skipped: list[set] = [set()]  # Per level: entries left alone (other filesystems).
  try:
    while True:
      entry = None
      with os.scandir(fd) as it:
        for e in it:
          if e.name not in skipped[-1]:
            entry = e
            break
      if entry is None:
        if not names:
          break
        parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
        os.close(fd)
        fd = parent
        name = names.pop()
        skipped.pop()
        try:
          os.rmdir(name, dir_fd=fd)
        except OSError:
          skipped[-1].add(name)
        continue
      name = entry.name
      est = entry.stat(follow_symlinks=False)
      if stat.S_ISDIR(est.st_mode):
        if est.st_dev != dev:
          skipped[-1].add(name)
          continue
        child = _open_dir(name, fd)
        os.close(fd)
        fd = child
        names.append(name)
        skipped.append(set())
      else:
        try:
          os.unlink(name, dir_fd=fd)
        except OSError:
          skipped[-1].add(name)
  finally:
    os.close(fd)
  os.rmdir(path)


def render_name(raw: bytes) -> str:
  """A file name as one safe line: as it is when printable UTF-8, else a quoted,
  escaped literal (newlines, control characters and bytes that are not UTF-8 shown as
  escapes), so a name cannot forge lines or fields of an observation."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError:
    return repr(raw)
  if text.isprintable() and "\\" not in text and not text.startswith(("'", '"', "b'", 'b"')):
    return text
  return repr(text)


class Workspace:
  """A fresh directory owned by `owner_uid` (the sandbox's uid), removed by `close()`.

  With `quota_bytes` and the host running as root it is a tmpfs of that size and
  `max_files` inodes (`self.quota` says whether it is)."""

  def __init__(self, root: str = "", owner_uid: int | None = None,
               quota_bytes: int | None = None, max_files: int | None = None):
    self._owner = owner_uid
    self.path = os.path.join(_workspace_parent(root), f"ep-{uuid.uuid4().hex[:16]}")
    os.mkdir(self.path, 0o700)
    self.quota = False
    if quota_bytes is not None and os.geteuid() == 0:
      owner = f",uid={owner_uid},gid={owner_uid}" if owner_uid is not None else ""
      try:
        _libc_call("mount", b"tmpfs", self.path.encode(), b"tmpfs", 2 | 4,  # nosuid, nodev
                   f"size={quota_bytes},nr_inodes={max_files or 4096},mode=0700{owner}".encode())
        self.quota = True
      except OSError as e:
        _warn_no_quota(f"mounting a tmpfs for the workspace failed ({e})")
    elif quota_bytes is not None:
      _warn_no_quota("the host is not root")
    self._real = os.path.realpath(self.path)
    self._chown(self.path)
    self.closed = False

  def _chown(self, path: str) -> None:
    if self._owner is not None:
      os.chown(path, self._owner, self._owner, follow_symlinks=False)

  def close(self) -> None:
    """Removes the workspace (whatever the sandbox left in it); never raises."""
    if not self.closed:
      self.closed = True
      _rmtree(self.path)

  def usage(self) -> tuple[int, int] | None:
    """(bytes free, inodes free) of the quota'd workspace, or None without a quota."""
    if not self.quota:
      return None
    st = os.statvfs(self._real)
    return st.f_bavail * st.f_frsize, st.f_favail

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

  def read_bytes(self, rel: str, max_bytes: int) -> bytes:
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
    return data

  def read_text(self, rel: str, max_bytes: int) -> str:
    return self.read_bytes(rel, max_bytes).decode("utf-8", errors="replace")

  def write_text(self, rel: str, text: str, must_exist: bool = True) -> None:
    """Atomically replaces `rel` (a symlink there is replaced, never followed).

    Text UTF-8 cannot encode (a lone surrogate) or a failed write raises FileToolError
    and leaves `rel` as it was, with no temporary file behind.
    """
    try:  # Before any file is made.
      data = text.encode("utf-8")
    except UnicodeEncodeError as e:
      line = text.count("\n", 0, e.start) + 1
      raise FileToolError(f"cannot write {rel}: the text is not valid UTF-8 (lone surrogate "
                          f"at line {line})") from None
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
    try:
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o644)
    except OSError as e:
      raise FileToolError(f"cannot write {rel}: {e.strerror or e}") from None
    try:
      try:
        view = memoryview(data)
        while view:  # A full quota can cut a write short before it fails.
          view = view[os.write(fd, view):]
        if self._owner is not None:
          os.fchown(fd, self._owner, self._owner)
      finally:
        os.close(fd)
      os.replace(tmp, real)
    except BaseException as e:
      try:
        os.unlink(tmp)
      except OSError:
        pass
      if isinstance(e, OSError):
        raise FileToolError(f"cannot write {rel}: {e.strerror or e}") from None
      raise

  def restore_file(self, rel: str, text: str) -> None:
    """Writes a pristine copy of `rel`, whatever the sandbox left at that name."""
    lexical = self.resolve(rel, follow_final=False)
    if os.path.islink(lexical) or (os.path.lexists(lexical) and not os.path.isfile(lexical)):
      if os.path.isdir(lexical) and not os.path.islink(lexical):
        remove_tree(lexical)
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
    """Lines 'path (N lines)' in depth-first order (files of a directory sorted, then its
    subdirectories), names escaped, and the count of entries found. Bounded: depth
    _LIST_MAX_DEPTH, _LIST_MAX_VISITED directory entries, _LIST_MAX_SECONDS; what the
    bounds cut is said in a last line."""
    entries: list[str] = []
    deadline = time.monotonic() + _LIST_MAX_SECONDS
    visited, cut = 0, ""
    root = os.open(self._real, _DIR_FLAGS)
    stack = [(root, b"")]  # Directories still to list: (fd, rel path prefix). At most depth fds.
    try:
      while stack and not cut:
        fd, prefix = stack.pop()
        try:
          subdirs, files = [], []
          with os.scandir(fd) as it:
            for e in it:
              visited += 1
              if visited > _LIST_MAX_VISITED or time.monotonic() > deadline:
                cut = "listing stopped early: too many entries"
                break
              name = os.fsencode(e.name)
              try:
                st = e.stat(follow_symlinks=False)
              except OSError:
                continue
              if stat.S_ISDIR(st.st_mode):
                if name not in _SKIP_DIRS:
                  subdirs.append(name)
              else:
                files.append((name, st))
          for name, st in sorted(files):
            entries.append(f"{render_name(prefix + name)} {self._describe(fd, name, st, max_bytes)}")
          if len(entries) > max_entries:
            break
          depth = prefix.count(b"/")
          children = []
          for name in sorted(subdirs):
            if depth + 1 >= _LIST_MAX_DEPTH:
              cut = f"directories deeper than {_LIST_MAX_DEPTH} levels not listed"
              break
            try:
              children.append((os.open(name, _DIR_FLAGS, dir_fd=fd), prefix + name + b"/"))
            except OSError:
              entries.append(f"{render_name(prefix + name)} (unreadable directory)")
          stack.extend(reversed(children))
        finally:
          os.close(fd)
    finally:
      for fd, _ in stack:
        os.close(fd)
    total = len(entries)
    shown = entries[:max_entries]
    if cut:
      shown.append(f"[{cut}]")
    return shown, total

  @staticmethod
  def _describe(dir_fd: int, name: bytes, st, max_bytes: int) -> str:
    if stat.S_ISLNK(st.st_mode):
      return "(symlink)"
    if not stat.S_ISREG(st.st_mode):
      return "(special file)"
    if st.st_size > max_bytes:
      return f"({st.st_size} bytes)"
    try:
      fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                   dir_fd=dir_fd)
    except OSError:
      return "(unreadable)"
    try:
      data = os.read(fd, max_bytes + 1)
    except OSError:
      return "(unreadable)"
    finally:
      os.close(fd)
    n = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    return f"({n} lines)"
