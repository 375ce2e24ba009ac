"""Runs untrusted Python in a per-episode sandbox: bubblewrap, or an rlimit fallback.

Every sandboxed process is started as one subprocess chain, without
preexec_fn (so it is safe from many host threads at once):

  bubblewrap: [setpriv (drop to the sandbox uid)] prlimit LIMITS bwrap
              --unshare-all --die-with-parent --new-session, read-only /usr (+ the
              interpreter's prefix), tmpfs /tmp, the workspace read-write at
              /workspace, nothing else; no network, no view of host processes.
  fallback:   [unshare -n] [setpriv (drop to the sandbox uid)] prlimit LIMITS python;
              no network when `unshare -n` works here.

LIMITS are RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE and
RLIMIT_CORE=0. RLIMIT_NPROC counts every process of a uid and does not bind
root, so when the host runs as root each sandbox runs as its own uid, drawn
from [uid_base, uid_base + uid_count): the process bound is then exact per
episode, the host's files and processes are out of reach by permission, and
`kill -KILL -1` run as that uid ends every process of the sandbox at once,
even processes that left their process group (a fork bomb cannot outrun it:
the kernel signals them all under one lock).

Code runs through `request(payload)`: the episode's fork server
(sandbox_server.py) imports the stdlib once, and each request runs in fresh
user, pid, mount and IPC namespaces of its own (where the kernel allows): its
init's exit kills everything the request started before the server answers,
it sees a private /proc, and a graded run imports a read-only copy of the
module alone. The server answers on a control pipe no request process holds,
so printed output cannot end a call. After a timeout or too much output the
request's processes are killed (in the fallback with a uid drop, all but the
server, which then reaps them and carries on; elsewhere the whole sandbox,
and the next request starts a new server). Without per-call namespaces the
server ends each request with `kill(-1)` as the sandbox uid (it spares the
server; a /proc scan alone misses a chain that keeps forking), and a crash,
or any process surviving its request, also ends the whole sandbox.
Where survivors cannot be detected (fallback without the uid drop) the server
is killed after every request. Output is captured up to a bound (head and
tail of each stream) and a command writing more than `output_kill_bytes` is
killed. Under bubblewrap /tmp and /dev/shm are sized tmpfs, /dev is
read-only, and what they may hold comes off RLIMIT_AS; run as root, the
workspace is a tmpfs of the episode's disk quota (workspace.py).

What each level cannot give here is logged at the probe (`missing_guarantees`,
also tabled in WORKSPACE.md): the fallback has no mount namespace (host files
readable, the host's /tmp, the host's workspace path); a host that is not
root has no uid drop and no disk quota; a kernel that refuses nested user
namespaces has no per-call pid namespace. Bubblewrap as root has none of
these gaps.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time


from agentic_rl.envs import cgroup, sandbox_server
from agentic_rl.envs.config import EnvSpec, validate_env_config
from agentic_rl.envs.workspace import Workspace, remove_tree

log = logging.getLogger(__name__)

SANDBOX_WORKDIR = "/workspace"  # Where bubblewrap mounts the workspace.
SANDBOX_STAGE_DIR = "/grade"  # Where it mounts the staging directory, without per-call ns.
_SERVER_START_TIMEOUT_S = 30.0  # Start-up is ours (no agent code runs); generous under load.
_SERVER_RECOVER_TIMEOUT_S = 2.0  # For the server to answer once its request was killed.
_LEASE_DIR = os.path.join(tempfile.gettempdir(), "agentic_rl_sandbox_uids")
with open(sandbox_server.__file__, "rb") as _f:
  _SERVER_SOURCE = _f.read()
# Reads the server's source, length-prefixed, from stdin: neither it nor its settings
# (which name host paths in the fallback) are in any process's argv.
_BOOTSTRAP = ("import os\n"
              "def _r(n):\n"
              " b = b''\n"
              " while len(b) < n:\n"
              "  c = os.read(0, n - len(b))\n"
              "  if not c: raise SystemExit('sandbox: no server source on stdin')\n"
              "  b += c\n"
              " return b\n"
              "exec(compile(_r(int.from_bytes(_r(4), 'big')), '<init>', 'exec'))\n")
_MAX_FRAME_BYTES = 64 << 20  # A control frame larger than this is a broken server.


class IsolationUnavailable(RuntimeError):
  """The requested isolation level cannot run on this host."""


@dataclasses.dataclass(frozen=True)
class RunResult:
  exit_code: int | None  # None when killed by the sandbox (timeout / output limit).
  stdout: str  # Head and tail of stdout, with a marker where bytes were left out.
  stderr: str
  stdout_bytes: int  # Bytes the command wrote in total.
  stderr_bytes: int
  timed_out: bool
  output_limited: bool  # Killed for writing more than output_kill_bytes.
  duration_s: float
  signal: int | None = None  # The signal that ended the main process, if any.
  crashed: str = ""  # Why the sandbox ended without answering (server requests), else "".
  oom_killed: bool = False  # The kernel killed a process of it at total_memory_mb.
  reply: str | None = None  # A graded call's reply (JSON text from the sandbox), if any.
  reply_oversized: bool = False  # The reply passed sandbox.max_reply_bytes and was dropped.


class _HeadTail:
  """Keeps the first and last `cap // 2` bytes of a stream."""

  def __init__(self, cap: int):
    self.half = cap // 2
    self.head = bytearray()
    self.tail = bytearray()
    self.total = 0

  def add(self, data: bytes) -> None:
    self.total += len(data)
    room = self.half - len(self.head)
    if room > 0:
      self.head += data[:room]
      data = data[room:]
    if data:
      self.tail += data
      if len(self.tail) > self.half:
        del self.tail[: len(self.tail) - self.half]

  def text(self) -> str:
    kept = len(self.head) + len(self.tail)
    mid = b"" if kept >= self.total else (
        f"\n[... {self.total - kept} bytes left out ...]\n".encode())
    return (bytes(self.head) + mid + bytes(self.tail)).decode("utf-8", errors="replace")


class _UidPool:
  """Sandbox uids leased across processes: one flock'ed file per uid under _LEASE_DIR.

  Several processes on one host (a trainer, a benchmark, a test run) may run
  sandboxes at once; a uid is never shared, since `kill -1` as that uid would
  reach the other's processes. A crashed holder's lock goes with its process.
  Uids are tried from a random start so a just-released uid is rarely reused at once.
  """

  def __init__(self, base: int, count: int):
    self._lock = threading.Lock()
    self._base, self._count = base, count
    self._held: dict[int, int] = {}  # uid -> fd holding its lock
    self._rng = random.Random(os.getpid() ^ time.time_ns())

  def acquire(self) -> int:
    with self._lock:
      _ensure_lease_dir()
      start = self._rng.randrange(self._count)
      for k in range(self._count):
        uid = self._base + (start + k) % self._count
        if uid in self._held:
          continue
        fd = os.open(os.path.join(_LEASE_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o600)
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
          os.close(fd)
          continue
        self._held[uid] = fd
        return uid
      raise RuntimeError(f"all {self._count} sandbox uids are in use; close envs or raise "
                         "sandbox.uid_count")

  def release(self, uid: int) -> None:
    with self._lock:
      fd = self._held.pop(uid, None)
      if fd is not None:
        os.close(fd)  # Releases the flock.


def _ensure_lease_dir() -> None:
  os.makedirs(_LEASE_DIR, mode=0o700, exist_ok=True)
  st = os.lstat(_LEASE_DIR)
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
    raise IsolationUnavailable(f"{_LEASE_DIR} must be a directory owned by uid {os.geteuid()} "
                               "and not writable by others")


_pools_lock = threading.Lock()
_pools: dict[tuple[int, int], _UidPool] = {}


def _uid_pool(base: int, count: int) -> _UidPool:
  with _pools_lock:
    return _pools.setdefault((base, count), _UidPool(base, count))


def _drops_uid() -> bool:
  return os.geteuid() == 0


def _which(name: str) -> str:
  path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
  if path is None:
    raise IsolationUnavailable(f"the sandbox needs {name!r} (util-linux / procps); install it")
  return path


def _world_usable(path: str) -> bool:
  """True when every ancestor is world-traversable and the file world-executable."""
  real = os.path.realpath(path)
  try:
    if not os.stat(real).st_mode & stat.S_IXOTH:
      return False
    d = os.path.dirname(real)
    while True:
      if not os.stat(d).st_mode & stat.S_IXOTH:
        return False
      if d == "/":
        return True
      d = os.path.dirname(d)
  except OSError:
    return False


def _python_candidates(setting: str) -> list[str]:
  if setting != "auto":
    return [setting]
  cands = [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
  out = []
  for c in cands:
    if c and os.path.exists(c) and os.path.realpath(c) not in out:
      if not _drops_uid() or _world_usable(c):
        out.append(os.path.realpath(c))
  return out


@dataclasses.dataclass(frozen=True)
class _Isolation:
  level: str  # "bubblewrap" or "fallback"
  python: str
  python_prefix: str  # Bound read-only into bubblewrap when outside /usr.
  network_isolated: bool
  drops_uid: bool
  description: str
  nested: bool = False  # The kernel allows the server's per-call namespaces here.
  memory_cgroup: bool = False  # A memory cgroup per sandbox can be made here.


_iso_lock = threading.Lock()
_iso_cache: dict[tuple, _Isolation] = {}


def resolve_isolation(config: EnvSpec) -> _Isolation:
  """Probes (once per process and setting) which isolation level runs here."""
  s = config.sandbox
  key = (s.isolation, s.python, s.workspace_root, s.uid_base, s.uid_count,
         s.per_call_namespaces, s.memory_cgroup)
  with _iso_lock:
    if key in _iso_cache:
      return _iso_cache[key]
    iso = _probe(config)
    _iso_cache[key] = iso
    log.info("sandbox isolation: %s", iso.description)
    return iso


def _probe(config: EnvSpec) -> _Isolation:
  s = config.sandbox
  pythons = _python_candidates(s.python)
  if not pythons:
    raise IsolationUnavailable(
        f"no python interpreter the sandbox uid can run (tried {sys.executable}, "
        "/usr/bin/python3); set sandbox.python to a world-readable python3")
  reasons = []
  levels = ["bubblewrap", "fallback"] if s.isolation == "auto" else [s.isolation]
  for level in levels:
    if level == "bubblewrap" and shutil.which("bwrap") is None:
      reasons.append("bubblewrap: bwrap is not installed (Debian package 'bubblewrap')")
      continue
    for py in pythons:
      prefix = os.path.dirname(os.path.dirname(py))
      for net in ([True, False] if level == "fallback" else [True]):
        iso = _Isolation(level, py, prefix, net, _drops_uid(), "")
        ok, why, nested = _probe_one(config, iso)
        if ok:
          iso = dataclasses.replace(iso, nested=nested, memory_cgroup=(
              s.memory_cgroup != "off" and cgroup.parent() is not None))
          if level == "fallback" and s.isolation == "auto":
            log.warning("sandbox: bubblewrap is not usable here (%s); using the rlimit fallback",
                        "; ".join(reasons) or "not tried")
          desc = (f"{level} (python {py}; "
                  f"{'per-sandbox uid' if iso.drops_uid else 'host uid, no uid drop'}; "
                  f"{'no network' if net else 'NETWORK NOT ISOLATED: unshare -n failed'}; "
                  f"{'per-call pid/mount namespaces' if nested else 'NO per-call namespaces'})")
          missing = missing_guarantees(iso)
          if missing:
            log.warning("sandbox %s cannot give: %s", level, "; ".join(missing))
          if not net:
            log.warning("sandbox: unshare -n does not work here; the fallback has network")
          return dataclasses.replace(iso, description=desc)
        reasons.append(f"{level} with {py}{'' if net else ' without unshare -n'}: {why}")
  raise IsolationUnavailable(f"sandbox isolation {s.isolation!r} is not available: "
                             + "; ".join(reasons))


def _probe_one(config, iso: _Isolation) -> tuple[bool, str, bool]:
  """(works, why not, per-call namespaces available)."""
  try:
    sb = Sandbox(config, _isolation=iso)
  except (OSError, IsolationUnavailable) as e:
    return False, str(e), False
  try:
    r = sb.request({"kind": "python", "code": "print(6 * 7)"}, timeout_s=20.0)
    nested = sb.per_call_namespaces
  except OSError as e:
    return False, str(e), False
  finally:
    sb.close()
  if r.exit_code == 0 and r.stdout.strip() == "42":
    return True, "", nested
  return False, ((r.crashed or f"exit {r.exit_code}")
                 + f": {(r.stderr or r.stdout).strip()[-300:]}"), False


def missing_guarantees(iso: _Isolation) -> list[str]:
  """The sandbox guarantees this isolation level cannot give on this host (WORKSPACE.md)."""
  out = []
  if iso.level == "fallback":
    out += ["no mount namespace: host files that are world-readable can be read, and "
            "world-writable directories written",
            "/tmp and /dev/shm are the host's: not sized, not counted in the memory limit",
            "the workspace path is the host's"]
  if not iso.drops_uid:
    out += ["no per-sandbox uid (host not root): RLIMIT_NPROC is relative to the host uid's "
            "process count, survivors outside the process group are not found, signals to "
            "host processes are not stopped",
            "no per-episode disk quota (only each file is bounded)"]
  if not iso.nested:
    out += ["no per-call pid namespace: a process that leaves its process group is killed by "
            "uid (kill(-1) as the uid), and only where the uid is the sandbox's own",
            "no private /proc: host processes are visible"]
  if not iso.memory_cgroup:
    out.append("no memory cgroup: memory is bounded per process (RLIMIT_AS), not in total, "
               "and pages held outside a mapping (memfd, pipes) are not counted")
  if not iso.network_isolated:
    out.append("network not isolated")
  return out


def _proc_uid_state(pid: str) -> tuple[int, str] | None:
  """(real uid, state) of a process from /proc/PID/status, or None if it is gone.

  Not the owner of /proc/PID: that is root for non-dumpable processes (bwrap is one).
  """
  try:
    with open(f"/proc/{pid}/status") as f:
      text = f.read()
  except OSError:
    return None
  uid = state = None
  for line in text.split("\n"):
    if line.startswith("State:"):
      state = line.split()[1]
    elif line.startswith("Uid:"):
      uid = int(line.split()[1])
      break
  if uid is None or state is None:
    return None
  return uid, state


def _live_pids_of_uid(uid: int) -> list[int]:
  """Processes whose real uid is `uid`, zombies excepted (dead; their reaper is not ours)."""
  out = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      us = _proc_uid_state(name)
      if us is not None and us[0] == uid and us[1] not in ("Z", "X"):
        out.append(int(name))
  return out


def _count_uid_processes(uid: int) -> int:
  n = 0
  for name in os.listdir("/proc"):
    if name.isdigit():
      us = _proc_uid_state(name)
      n += us is not None and us[0] == uid
  return n


def _sigkill(pids) -> None:
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass  # Already gone, or no longer ours.


class _FrameReader:
  """Length-prefixed JSON frames from the server's control pipe."""

  def __init__(self):
    self._buf = bytearray()
    self.broken = False

  def add(self, data: bytes) -> None:
    self._buf += data

  def pop(self):
    if len(self._buf) < 4:
      return None
    n = int.from_bytes(self._buf[:4], "big")
    if n > _MAX_FRAME_BYTES:
      self.broken = True
      return None
    if len(self._buf) < 4 + n:
      return None
    data = bytes(self._buf[4:4 + n])
    del self._buf[:4 + n]
    try:
      return json.loads(data)
    except ValueError:
      self.broken = True
      return None


def _registered_keys(sel):
  return list(sel.get_map().values())


def _registered(sel):
  return [k.fileobj for k in sel.get_map().values()]


class Sandbox:
  """One episode's workspace plus the means to run Python in it, confined."""

  def __init__(self, config: EnvSpec, *, _isolation: _Isolation | None = None):
    config = validate_env_config(config)  # A built spec passes through unchecked.
    self._cfg = config.sandbox
    self._iso = _isolation if _isolation is not None else resolve_isolation(config)
    # The tools first: a missing one must not leave a uid, workspace or cgroup behind.
    drops = self._iso.drops_uid
    self._prlimit = _which("prlimit")
    self._setpriv = _which("setpriv") if drops else None
    self._kill = _which("kill") if drops else None
    self._unshare = _which("unshare") if (self._iso.level == "fallback"
                                          and self._iso.network_isolated) else None
    self._bwrap = shutil.which("bwrap") if self._iso.level == "bubblewrap" else None
    self._pool = None
    self.uid = None
    if drops:
      self._pool = _uid_pool(self._cfg.uid_base, self._cfg.uid_count)
      self.uid = self._pool.acquire()
    self.workspace = None
    self._stage_dir = None  # Host-side staging for graded runs, where calls share namespaces.
    self._cgroup = None
    try:
      self.workspace = Workspace(self._cfg.workspace_root, self.uid,
                                 quota_bytes=self._cfg.disk_quota_mb << 20,
                                 max_files=self._cfg.max_files)
      if self._iso.memory_cgroup:  # The host makes them (the probe's own sandbox does not).
        self._cgroup = self._make_cgroup()
    except BaseException:
      if self.workspace is not None:
        self.workspace.close()
      if self._pool is not None:
        self._pool.release(self.uid)
      raise
    self._server: subprocess.Popen | None = None
    self._control = None  # The server's control pipe (READY and DONE frames).
    self._server_ready = False
    self._request_seq = 0
    self.per_call_namespaces = False  # Whether the server runs each call in fresh namespaces.
    self.server_starts = 0
    self._closed = False
    if self.uid is not None:
      self.kill_all()  # Whatever a crashed earlier holder of this uid left running.

  def _make_cgroup(self) -> cgroup.MemoryCgroup | None:
    """This sandbox's memory cgroup, or None where the host makes none. Where the host does
    but this one cannot be made, the sandbox does not start ("auto": one sandbox unbounded
    beside bounded ones is a guarantee claimed and not given) or runs without it, saying
    so in its missing_guarantees ("best_effort")."""
    try:
      made = cgroup.MemoryCgroup.create(self._cfg.total_memory_mb << 20)
      if made is None:  # The probe found a parent; it is gone.
        raise OSError("no memory cgroup parent here any more")
      return made
    except OSError as e:
      if self._cfg.memory_cgroup != "best_effort":
        raise IsolationUnavailable(
            f"sandbox: {e}. This host gives each sandbox a memory cgroup of "
            f"sandbox.total_memory_mb; this one would run without that bound. Set "
            f"sandbox.memory_cgroup='best_effort' to run it anyway (its missing_guarantees "
            f"say so), or 'off' for none.") from e
      log.warning("sandbox: %s; this sandbox runs without a memory cgroup "
                  "(sandbox.memory_cgroup='best_effort')", e)
      return None

  @property
  def isolation(self) -> str:
    return self._iso.level

  @property
  def missing_guarantees(self) -> list[str]:
    """The guarantees this sandbox cannot give: its host's (missing_guarantees), and the
    memory cgroup where it has none of its own."""
    return missing_guarantees(dataclasses.replace(self._iso,
                                                  memory_cgroup=self._cgroup is not None))

  @property
  def description(self) -> str:
    return self._iso.description

  @property
  def workdir(self) -> str:
    """The workspace path as the sandboxed process sees it."""
    return SANDBOX_WORKDIR if self._iso.level == "bubblewrap" else self.workspace.path

  def _limits(self) -> list[str]:
    c = self._cfg
    nproc = c.max_processes
    if self.uid is None:  # RLIMIT_NPROC counts the uid's existing processes too.
      nproc += _count_uid_processes(os.getuid())
    # The memory budget covers the sandbox's RAM-backed mounts too: what /tmp and /dev/shm
    # may hold is taken off the address-space limit (both are sized tmpfs under bubblewrap).
    mem = (c.memory_mb - (c.tmpfs_mb + c.shm_mb if self._iso.level == "bubblewrap" else 0)) << 20
    fsize = c.file_size_mb << 20
    return [self._prlimit, f"--cpu={c.cpu_s}:{c.cpu_s}", f"--as={mem}:{mem}",
            f"--fsize={fsize}:{fsize}", f"--nproc={nproc}:{nproc}",
            f"--nofile={c.max_open_files}:{c.max_open_files}", "--core=0:0", "--"]

  def _env(self) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.workdir,
            "TMPDIR": "/tmp" if self._iso.level == "bubblewrap" else self.workdir,
            "PYTHONHASHSEED": "0"}

  def _command(self, python_args: list[str]) -> list[str]:
    cmd = self._confined_command(python_args)
    return self._cgroup.join_command(cmd) if self._cgroup is not None else cmd

  def _confined_command(self, python_args: list[str]) -> list[str]:
    py = [self._iso.python] + python_args
    drop = []
    if self.uid is not None:
      drop = [self._setpriv, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
              "--no-new-privs", "--"]
    if self._iso.level == "fallback":
      net = [self._unshare, "--net", "--"] if self._unshare else []
      if self.uid is None and self._unshare:  # Unprivileged: a user namespace is needed.
        net = [self._unshare, "--user", "--map-current-user", "--net", "--"]
      return net + drop + self._limits() + py
    bw = [self._bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
          "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "lib32", "libx32", "sbin"):
      p = "/" + name
      if os.path.islink(p):
        bw += ["--symlink", os.readlink(p), p]
      elif os.path.isdir(p):
        bw += ["--ro-bind", p, p]
    prefix = self._iso.python_prefix
    if prefix and prefix != "/usr" and not prefix.startswith("/usr/"):
      bw += ["--ro-bind", prefix, prefix]
    c = self._cfg
    bw += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
           "--proc", "/proc", "--dev", "/dev",
           "--size", str(c.shm_mb << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
           "--size", str(c.tmpfs_mb << 20), "--tmpfs", "/tmp",
           "--bind", self.workspace.path, SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR]
    if not self._iso.nested:  # Graded runs import from the host's staging directory.
      bw += ["--ro-bind", self.stage_dir(), SANDBOX_STAGE_DIR]
    bw += [
           "--hostname", "sandbox", "--remount-ro", "/", "--clearenv"]
    for k, v in self._env().items():
      bw += ["--setenv", k, v]
    return drop + self._limits() + bw + ["--"] + py

  # ---- the fork server (agentic_rl/envs/sandbox_server.py) ----

  @property
  def reuses_server(self) -> bool:
    """Whether one server serves many requests: only where leftovers can be detected."""
    return self._iso.level == "bubblewrap" or self.uid is not None

  def prestart(self) -> None:
    """Starts the fork server without waiting for it: its start-up then overlaps with
    whatever the caller does next (the policy's first generation, typically)."""
    if self._server is None and not self._closed:
      self._spawn_server()

  def _spawn_server(self) -> None:
    control_r, control_w = os.pipe()
    try:
      cmd = self._command(["-I", "-S", "-B", "-c", _BOOTSTRAP])
      self._server = subprocess.Popen(
          cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          cwd=self.workspace.path, env=self._env(), start_new_session=True, close_fds=True,
          pass_fds=(control_w,))
    except BaseException:
      os.close(control_r)
      raise
    finally:
      os.close(control_w)
    self._control = os.fdopen(control_r, "rb", buffering=0)
    self._server_ready = False
    try:
      settings = json.dumps({"control_fd": control_w, "workdir": self.workdir,
                             "check_leftovers": self.reuses_server,
                             "nested": self._cfg.per_call_namespaces == "auto"}).encode()
      settings += b"\n"
      self._server.stdin.write(len(_SERVER_SOURCE).to_bytes(4, "big") + _SERVER_SOURCE
                               + settings)
      self._server.stdin.flush()
    except OSError:
      pass  # It died at once; _start_server reports why from its stderr.

  def _start_server(self) -> str:
    """Makes sure a server is up and has said READY; returns "" or why it did not."""
    if self._server is None:
      self._spawn_server()
    if self._server_ready:
      return ""
    err = _HeadTail(4096)
    frames = _FrameReader()
    deadline = time.perf_counter() + _SERVER_START_TIMEOUT_S
    ready = None
    with selectors.DefaultSelector() as sel:
      sel.register(self._control, selectors.EVENT_READ, frames)
      sel.register(self._server.stderr, selectors.EVENT_READ, err)
      while ready is None:
        left = deadline - time.perf_counter()
        if left <= 0 or self._control not in _registered(sel):
          break
        for key, _ in sel.select(timeout=left):
          data = os.read(key.fd, 65536)
          if not data:
            sel.unregister(key.fileobj)
          else:
            key.data.add(data)
        got = frames.pop()
        if got is not None:
          ready = got if isinstance(got, dict) and got.get("ready") is True else False
    if ready:
      self.server_starts += 1
      self._server_ready = True
      self.per_call_namespaces = bool(ready.get("nested"))
      return ""
    self._stop_server()
    return f"the sandbox did not start: {err.text().strip()[-400:] or 'no output'}"

  def _stop_server(self) -> None:
    proc, self._server = self._server, None
    control, self._control = self._control, None
    if proc is None:
      return
    self._kill_tree(proc)
    for f in (proc.stdin, proc.stdout, proc.stderr, control):
      try:
        if f is not None:
          f.close()
      except OSError:
        pass
    proc.wait()

  def request(self, payload: dict, timeout_s: float | None = None) -> RunResult:
    """Runs one server request (see sandbox_server.py) in its own call namespaces.

    Returns once every process the request started is gone (or the sandbox was killed)."""
    if self._closed:
      raise RuntimeError("sandbox is closed")
    timeout = self._cfg.timeout_s if timeout_s is None else timeout_s
    t0 = time.perf_counter()
    self._request_seq += 1
    payload = dict(payload, id=self._request_seq)
    line = (json.dumps(payload) + "\n").encode()
    for attempt in (0, 1):
      if self._server is None or not self._server_ready:
        why = self._start_server()
        if why:
          return RunResult(None, "", "", 0, 0, False, False, time.perf_counter() - t0,
                           crashed=why)
      try:
        self._server.stdin.write(line)
        self._server.stdin.flush()
        break
      except (BrokenPipeError, OSError):  # It died since the last request: start anew.
        self._stop_server()
        if attempt:
          return RunResult(None, "", "", 0, 0, False, False, time.perf_counter() - t0,
                           crashed="the sandbox did not accept the request")
    ooms = self._cgroup.oom_kills() if self._cgroup is not None else 0
    # The wall clock starts once the server is up: its start-up is ours, not the request's.
    result, keep = self._await_done(payload["id"], t0, time.perf_counter() + timeout)
    if (result.timed_out or result.output_limited) and self._can_spare_server():
      # Kill the request's processes but not the server; it then reaps them and answers.
      self._kill_uid_except(self._server.pid)
      after, keep = self._await_done(payload["id"], time.perf_counter(),
                                     time.perf_counter() + _SERVER_RECOVER_TIMEOUT_S)
      keep = keep and not (after.timed_out or after.output_limited or after.crashed)
    if not keep or not self.reuses_server:
      self._stop_server()  # Kills every process of the sandbox before returning.
    if self._cgroup is not None and self._cgroup.oom_kills() > ooms:
      result = dataclasses.replace(result, oom_killed=True)
    return result

  def _can_spare_server(self) -> bool:
    """In the fallback with a uid drop the server's host pid is known (it exec'd from the
    Popen child); under bubblewrap it is not, and the pid namespace is torn down instead."""
    return (self._iso.level == "fallback" and self.uid is not None and self._server is not None
            and self._server.poll() is None)

  def _kill_uid_except(self, keep_pid: int) -> None:
    for _ in range(100):
      alive = [p for p in _live_pids_of_uid(self.uid) if p != keep_pid]
      if not alive:
        return
      _sigkill(alive)
      time.sleep(0.002)

  def _await_done(self, rid: int, t0: float, deadline: float) -> tuple[RunResult, bool]:
    """Captures stdout/stderr (bounded) until the server's DONE frame for `rid` arrives on
    the control pipe, the deadline passes or the output limit is hit."""
    proc = self._server
    out, err = _HeadTail(self._cfg.capture_bytes), _HeadTail(self._cfg.capture_bytes)
    frames = _FrameReader()
    timed_out = output_limited = False
    crashed, done = "", None
    with selectors.DefaultSelector() as sel:
      sel.register(proc.stdout, selectors.EVENT_READ, out)
      sel.register(proc.stderr, selectors.EVENT_READ, err)
      sel.register(self._control, selectors.EVENT_READ, frames)
      while done is None:
        left = deadline - time.perf_counter()
        if left <= 0:
          timed_out = True
          break
        if self._control not in _registered(sel):
          crashed = "the sandbox process ended before answering"
          break
        for key, _ in sel.select(timeout=left):
          data = os.read(key.fd, 65536)
          if not data:
            sel.unregister(key.fileobj)
            continue
          key.data.add(data)
        if out.total + err.total > self._cfg.output_kill_bytes:
          output_limited = True
          break
        if frames.broken:
          crashed = "the sandbox sent a malformed control frame"
          break
        got = frames.pop()
        if got is not None:
          if isinstance(got, dict) and got.get("id") == rid:
            done = got
          else:
            crashed = "the sandbox answered out of turn"
            break
      if done is not None:  # Every process of the call has exited: drain what they wrote.
        for key in list(_registered_keys(sel)):
          if key.data is frames:
            continue
          while any(k.fileobj is key.fileobj for k, _ in sel.select(0)):
            data = os.read(key.fd, 65536)
            if not data:
              break
            key.data.add(data)
    code, keep = None, False
    reply, reply_oversized = None, False
    if done is not None:
      try:
        code = None if done["code"] is None else int(done["code"])
        cpu_s = float(done["cpu_s"])
        reply = done.get("reply")
        reply = reply if isinstance(reply, str) else None
        reply_oversized = done.get("reply_oversized") is True
        if done.get("setup_error"):
          crashed = f"the sandbox could not set up the call: {str(done['setup_error'])[:200]}"
        keep = (done.get("dirty") is False and cpu_s < self._cfg.cpu_s / 2 and not crashed)
      except (KeyError, TypeError, ValueError):
        crashed = f"unreadable answer from the sandbox: {str(done)[:80]!r}"
    return RunResult(
        exit_code=code, stdout=out.text(), stderr=err.text(), stdout_bytes=out.total,
        stderr_bytes=err.total, timed_out=timed_out, output_limited=output_limited,
        duration_s=time.perf_counter() - t0,
        signal=-code if code is not None and code < 0 else None,
        crashed=crashed, reply=reply, reply_oversized=reply_oversized), keep

  def _kill_tree(self, proc: subprocess.Popen) -> None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    if self.uid is not None:
      self.kill_all()

  def kill_all(self) -> None:
    """Kills every process of this sandbox's uid: atomically as that uid, then checks."""
    if self.uid is None or self.uid == 0 or self.uid == os.getuid():
      return
    if not _live_pids_of_uid(self.uid):
      return  # Nothing runs (a fork bomb cannot have zero live processes).
    # kill(-1) as the uid signals all its processes under one kernel lock: a fork bomb
    # cannot outrun it. (procps kill: "-9 -- -1"; "-s KILL -- -1" is not accepted.)
    # setpriv drops the uid, not Popen(user=...): a uid change makes CPython fork() the
    # host, copying a trainer's page tables (~30 ms of kernel time each, measured with
    # perf), where a plain spawn uses vfork.
    subprocess.run([self._setpriv, f"--reuid={self.uid}", f"--regid={self.uid}",
                    "--clear-groups", "--", self._kill, "-9", "--", "-1"],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, close_fds=True, check=False)
    for _ in range(50):  # Belt and braces: whatever is still alive is killed from here.
      alive = _live_pids_of_uid(self.uid)
      if not alive:
        return
      _sigkill(alive)
      time.sleep(0.002)
    log.error("sandbox uid %d: processes survive SIGKILL: %s", self.uid, alive[:10])

  def per_call_namespaces_or_probe(self) -> bool:
    """Whether requests run in per-call namespaces; starts the server to find out."""
    if not self._server_ready and not self._closed:
      self._start_server()
    return self.per_call_namespaces

  def graded_stage_dir(self) -> str:
    """Where a graded run imports from, as the sandbox sees it: the workdir (overlaid in
    the call's own mount namespace), or else the host's staging directory."""
    if self.per_call_namespaces_or_probe():
      return self.workdir
    return SANDBOX_STAGE_DIR if self._iso.level == "bubblewrap" else self.stage_dir()

  def stage_dir(self) -> str:
    """The host directory a graded run imports from when calls share namespaces (hosts
    that refuse nested namespaces): root-owned, readable by the sandbox uid only."""
    if self._stage_dir is None:
      path = self.workspace.path + "-stage"
      os.mkdir(path, 0o755)
      self._stage_dir = path
    return self._stage_dir

  def close(self) -> None:
    """Kills every process of the sandbox, then removes its workspace; never raises on
    anything the sandbox left behind."""
    if self._closed:
      return
    self._closed = True
    try:
      try:
        self._stop_server()
        if self.uid is not None:
          self.kill_all()
      except Exception:  # Removing the workspace must still happen.
        log.exception("sandbox close: stopping the server failed")
      self.workspace.close()
      if self._cgroup is not None:
        self._cgroup.close()
      if self._stage_dir is not None:
        try:
          remove_tree(self._stage_dir)
        except OSError as e:
          log.error("could not remove %s: %s", self._stage_dir, e)
    finally:
      if self._pool is not None:
        self._pool.release(self.uid)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
