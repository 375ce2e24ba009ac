"""The program that runs inside the sandbox: a fork server for scripts and graded calls.

The host starts `python -I -S -B -c BOOTSTRAP` and sends this source,
length-prefixed, on stdin, then one JSON line of settings (CONTROL_FD, WORKDIR,
CHECK_LEFTOVERS, whether to try per-call namespaces): nothing is read from the
workspace, and neither the source nor a host path is in any process's argv.
The server imports the stdlib it needs once, before the workspace is on sys.path, writes a READY
frame and serves one JSON request per stdin line. It never runs agent code
itself and holds nothing secret: a graded request carries only each case's
inputs, never an expected value.

Channels. Requests come on stdin; the agent's processes write stdout/stderr,
which the host captures (bounded). The server's own frames (READY, and DONE
with the exit status and a graded run's reply) go to CONTROL_FD, a pipe that
no request process holds: nothing the agent prints can end a call or fake a
result. A frame is a 4-byte big-endian length and a JSON object.

Per-call namespaces ("nested"). Each request runs in a fresh user, pid, mount
and IPC namespace: the server forks A, A unshares and forks B, pid 1 of the
call. B mounts a private /proc (the call sees only its own processes), for a
graded call mounts a small read-only tmpfs over the workdir holding only the
module under repair (nothing the agent left in the workspace can shadow an
import), forbids further user namespaces, drops every capability and forks C,
which runs the request. When C exits B exits, and the kernel kills whatever
else the call started (setsid'd daemons included) before A's wait returns:
no process survives its call. The server makes itself non-dumpable, so even a
process that could name it could not read its memory. Where the kernel refuses
nested namespaces (some fallback hosts) a request runs in a forked child in
its own process group. There, where no ancestor shares the server's uid, the
server then sends SIGKILL to every process of its uid at once (kill(-1) spares
the caller, and a chain that keeps forking cannot outrun it the way it can
outrun a /proc scan); leftovers are then found by uid (CHECK_LEFTOVERS=1) and
reported as a dirty run, which makes the host kill the whole sandbox.

Requests:
  {"id", "kind": "python", "code"}
      Runs `code` as `python -` would (cwd on sys.path, __name__ == "__main__").
  {"id", "kind": "calls", "module", "module_file", "source_b64", "functions",
   "calls": [[function, encoded args], ...], "max_repr", "max_output",
   "max_value_chars", "max_reply_bytes", "stage_dir"}
      Imports the module (from the staged copy of `source_b64`), binds every
      name in `functions` as `from module import ...` would, then calls each
      function on its decoded args and replies, through a pipe to the server,
      with each outcome as plain tagged data (see encode_plain), the import
      error if any, and the captured prints. The host compares.
"""

import base64
import contextlib
import ctypes
import importlib
import io
import json
import os
import signal
import sys
import time
import traceback
import types

_CLONE_NEWNS, _CLONE_NEWIPC = 0x00020000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID = 0x10000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36
_MAX_DEPTH = 32  # Nesting of plain data, encoded or decoded.

try:
  _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - an interpreter without a usable libc.
  _LIBC = None


# ---- frames ----

def frame(obj) -> bytes:
  data = json.dumps(obj).encode("ascii")
  return len(data).to_bytes(4, "big") + data


def _write_all(fd, data):
  view = memoryview(data)
  while view:
    n = os.write(fd, view)
    view = view[n:]


# ---- plain data, tagged (this side of it is untrusted: the host decodes and checks) ----

def encode_plain(value, max_chars):
  """A JSON-able tagged form of `value`, or None if it is not plain data (exact types
  int, bool, float, str, bytes, None, list, tuple, dict) or its JSON text (ASCII, as
  the reply is written) exceeds max_chars."""
  budget = [max_chars]

  def enc(v, depth):
    budget[0] -= 4
    if budget[0] < 0 or depth > _MAX_DEPTH:
      raise OverflowError
    t = type(v)
    if v is None:
      return ["N"]
    if t is bool:
      return ["B", v]
    if t is int:
      s = str(v)
      budget[0] -= len(s)
      return ["I", s]
    if t is float:
      return ["F", float.__repr__(v)]
    if t is str:
      budget[0] -= len(v)
      return ["S", v]
    if t is bytes:
      budget[0] -= 2 * len(v)
      return ["Y", v.hex()]
    if t is list or t is tuple:
      return ["L" if t is list else "T", [enc(x, depth + 1) for x in v]]
    if t is dict:
      return ["D", [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in dict.items(v)]]
    raise TypeError

  try:
    out = enc(value, 0)
    # The budget is a cheap lower bound; the text's real size (escapes included) decides.
    return out if len(json.dumps(out)) <= max_chars else None
  except (OverflowError, TypeError, ValueError, RecursionError):
    return None


class MalformedReply(ValueError):
  """Tagged data (or a reply) that is not what encode_plain / a graded run writes."""


# Caps the decoder checks as it goes, so a hostile reply costs time linear in its size.
MAX_DICT_ITEMS = 256  # Entries of one dict.
_MAX_INT_DIGITS = 4300  # CPython's own int-from-str limit.


def decode_plain(tagged, max_chars: int = 1 << 62, dict_from_items=dict):
  """The value of encode_plain's tagged form; MalformedReply on anything else.

  At most _MAX_DEPTH levels deep, MAX_DICT_ITEMS entries a dict, and `max_chars` in all,
  charged as encode_plain charges: an honest value within max_chars always decodes.
  `dict_from_items` builds each dict from its decoded (key, value) pairs; the host
  passes one that never hashes an untrusted key (see grading.PlainDict)."""
  budget = [max_chars]

  def dec(node, depth):
    budget[0] -= 4
    if budget[0] < 0:
      raise MalformedReply(f"value larger than {max_chars} chars")
    if depth > _MAX_DEPTH:
      raise MalformedReply(f"value nested deeper than {_MAX_DEPTH}")
    if type(node) is not list or not node:
      raise MalformedReply("not a tagged value")
    tag, rest = node[0], node[1:]
    if len(rest) > 1 or (tag != "N" and len(rest) != 1) or (tag == "N" and rest):
      raise MalformedReply(f"bad tagged value {short_repr(node, 40)}")
    arg = rest[0] if rest else None
    if tag == "N":
      return None
    if tag == "B" and type(arg) is bool:
      return arg
    if tag in ("I", "F", "S", "Y") and type(arg) is str:
      budget[0] -= len(arg)
      if budget[0] < 0:
        raise MalformedReply(f"value larger than {max_chars} chars")
      try:
        if tag == "I" and len(arg) <= _MAX_INT_DIGITS:
          return int(arg)
        if tag == "F" and len(arg) <= 64:
          return float(arg)
        if tag == "S":
          return arg
        if tag == "Y":
          return bytes.fromhex(arg)
      except ValueError as e:  # int("x"), bytes.fromhex("zz").
        raise MalformedReply(str(e)[:80]) from None
    if tag in ("L", "T") and type(arg) is list:
      items = [dec(x, depth + 1) for x in arg]
      return items if tag == "L" else tuple(items)
    if tag == "D" and type(arg) is list:
      if len(arg) > MAX_DICT_ITEMS:
        raise MalformedReply(f"dict of {len(arg)} entries, over {MAX_DICT_ITEMS}")
      pairs = []
      for pair in arg:
        if type(pair) is not list or len(pair) != 2:
          raise MalformedReply("bad dict item")
        pairs.append((dec(pair[0], depth + 1), dec(pair[1], depth + 1)))
      try:
        return dict_from_items(pairs)
      except TypeError as e:  # An unhashable key.
        raise MalformedReply(str(e)[:80]) from None
    raise MalformedReply(f"unknown or ill-typed tag {short_repr(tag, 20)}")

  return dec(tagged, 0)


def reply_limit(num_calls: int, max_value_chars: int, max_repr: int, max_output: int) -> int:
  """The most bytes an honest reply to a graded run of `num_calls` calls takes.

  Each outcome is a value of at most max_value_chars (encode_plain's bound), or a repr or
  an error of at most 3 * max_repr chars (describe_error's bound), each char escaped to at
  most 12 bytes; plus the captured output and the import error."""
  per_call = max(max_value_chars, 12 * 3 * max_repr) + 64
  return 512 + 12 * (max_output + 3 * max_repr) + num_calls * per_call


# ---- reports of errors ----

def short_repr(value, limit):
  try:
    r = repr(value)
  except BaseException as e:  # A hostile __repr__ must not break the report.
    r = f"<unrepresentable {type(value).__name__}: {type(e).__name__}>"
  if not isinstance(r, str):
    r = f"<unrepresentable {type(value).__name__}>"
  return r if len(r) <= limit else r[: limit - 3] + "..."


def _where(tb, workdir):
  frames = [f for f in traceback.extract_tb(tb) if f.filename.startswith(workdir + os.sep)]
  if not frames:
    return ""
  return f"{os.path.relpath(frames[-1].filename, workdir)}:{frames[-1].lineno}"


def describe_error(exc, workdir, limit):
  """("Type: message", "file:line"), each at most 2 * limit and limit chars (reply_limit)."""
  if isinstance(exc, SyntaxError):
    text = f"SyntaxError: {str(exc.msg)[:limit]}"
    where = f"{os.path.basename(str(exc.filename or '?'))}:{exc.lineno}"
  else:
    try:
      msg = str(exc)
    except BaseException:
      msg = ""
    text = f"{type(exc).__name__[:limit]}: {msg[:limit]}".rstrip(": ")
    where = _where(exc.__traceback__, workdir)
  return text[:2 * limit], where[-limit:]


# ---- the request bodies (run in C, the agent's process) ----

def run_calls(req, workdir, reply_fd):
  max_repr = int(req["max_repr"])
  max_chars = int(req["max_value_chars"])
  reply = {"import_error": None, "import_where": "", "outcomes": [], "output": ""}
  captured = io.StringIO()
  with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
    try:
      module = importlib.import_module(req["module"])
      bound = []
      for name in req["functions"]:  # As `from module import a, b` binds them, in order.
        if not hasattr(module, name):
          where = getattr(module, "__file__", None) or "unknown location"
          raise ImportError(f"cannot import name {name!r} from {req['module']!r} ({where})")
        bound.append(getattr(module, name))
      functions = dict(zip(req["functions"], bound))
    except BaseException as e:  # SyntaxError, SystemExit at import, ...: all reported.
      reply["import_error"], reply["import_where"] = describe_error(e, workdir, max_repr)
    else:
      for name, args in req["calls"]:
        try:
          value = functions[name](*[decode_plain(a) for a in args])
        except BaseException as e:
          text, where = describe_error(e, workdir, max_repr)
          reply["outcomes"].append({"status": "error", "error": text, "where": where})
          continue
        tagged = encode_plain(value, max_chars)
        if tagged is None:
          reply["outcomes"].append({"status": "value", "repr": short_repr(value, max_repr)})
        else:
          reply["outcomes"].append({"status": "value", "value": tagged})
  reply["output"] = captured.getvalue()[: int(req["max_output"])]
  try:
    _write_all(reply_fd, json.dumps(reply).encode("ascii"))
  except OSError:  # The server stopped reading (an oversized reply): it reports that.
    pass
  return 0


def run_script(req):
  main = types.ModuleType("__main__")
  sys.modules["__main__"] = main
  sys.argv = ["-"]
  sys.path.insert(0, "")
  try:
    exec(compile(req["code"], "<stdin>", "exec"), main.__dict__)
  except SystemExit as e:
    if e.code is None:
      return 0
    if isinstance(e.code, int):
      return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1
  except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    return 1
  return 0


def _run_request(req, workdir, reply_fd, status_fd):
  """C's body: the stdio it needs, then the request; never returns."""
  os.close(status_fd)  # Only trusted code (A, B) may report the call's status.
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  sys.stdin = open(0, closefd=False)
  signal.signal(signal.SIGPIPE, signal.SIG_DFL)
  sys.dont_write_bytecode = True
  # Bytecode is looked up under a prefix that does not exist: planted .pyc files are ignored.
  sys.pycache_prefix = "/nonexistent/agentic_rl_pycache"
  if _LIBC is not None:  # The agent's own process behaves as any other (A and B do not).
    _LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
  try:  # At the sandbox's memory limit the kernel kills the agent's processes first.
    _write_file("/proc/self/oom_score_adj", "1000")
  except OSError:
    pass
  code = 1
  try:
    if req.get("kind") == "calls":
      stage = req["stage_dir"]
      sys.path.insert(0, stage)
      os.chdir(stage)
      code = run_calls(req, stage, reply_fd)
    elif req.get("kind") == "python":
      code = run_script(req)
    else:
      print(f"unknown request kind {req.get('kind')!r}", file=sys.stderr)
  except BaseException:
    traceback.print_exc()
  finally:
    for f in (sys.stdout, sys.stderr):
      try:
        f.flush()
      except BaseException:
        pass
    os._exit(code)


# ---- per-call namespaces ----

def _write_file(path, text):
  fd = os.open(path, os.O_WRONLY)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


def _mount(source, target, fstype, flags, data):
  enc = lambda s: None if s is None else s.encode()
  if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


class _CapHeader(ctypes.Structure):
  _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
  _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
              ("inheritable", ctypes.c_uint32)]


def _drop_capabilities():
  header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
  if _LIBC.capset(ctypes.byref(header), data) != 0:
    raise OSError(ctypes.get_errno(), "capset")


def _enter_call_namespaces(uid, gid):
  """In A: a new user, pid, mount and IPC namespace, mapping our uid to itself."""
  _LIBC.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # Our own /proc/self/*_map must be writable.
  try:
    if _LIBC.unshare(_CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWIPC) != 0:
      raise OSError(ctypes.get_errno(), "unshare")
    _write_file("/proc/self/setgroups", "deny")
    _write_file("/proc/self/uid_map", f"{uid} {uid} 1")
    _write_file("/proc/self/gid_map", f"{gid} {gid} 1")
  finally:  # B inherits this: the agent's process C cannot trace or read B.
    _LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def _stage(req):
  """In B: the workdir becomes a read-only tmpfs holding only the module under repair."""
  stage_dir = req["stage_dir"]
  source = base64.b64decode(req["source_b64"]) if req.get("source_b64") is not None else None
  size = 65536 + (len(source) if source else 0) * 2
  _mount("tmpfs", stage_dir, "tmpfs", _MS_NOSUID | _MS_NODEV,
         f"size={size},nr_inodes=16,mode=0755")
  if source is not None:
    fd = os.open(os.path.join(stage_dir, req["module_file"]),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
      _write_all(fd, source)
    finally:
      os.close(fd)
  _mount(None, stage_dir, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None)


def _confine(req):
  """B's setup, as pid 1 of fresh namespaces: a private /proc, the staged module for a
  graded request, no further user namespaces, no capabilities."""
  _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
  if req is not None and req.get("kind") == "calls":
    _stage(req)
  _write_file("/proc/sys/user/max_user_namespaces", "0")
  _drop_capabilities()


def _setup_failed(status_fd, error):
  os.write(status_fd, f"setup {error}\n".encode("ascii", "replace"))
  os._exit(1)


def _fork_into(body, reply_fd):
  """Forks a child that runs body() (which never returns); the parent keeps no copy of
  the reply pipe, so its end of file means the child and all it started are gone."""
  pid = os.fork()
  if pid == 0:
    body()
  if reply_fd is not None:
    os.close(reply_fd)
  return pid


def _call_init(req, workdir, reply_fd, status_fd):
  """B, pid 1 of the call: confines the call, then C runs the request, and B writes C's
  wait status to status_fd. B's exit ends every process of the call."""
  try:
    _confine(req)
  except OSError as e:
    _setup_failed(status_fd, e)
  pid = _fork_into(lambda: _run_request(req, workdir, reply_fd, status_fd), reply_fd)
  status = None
  while status is None:  # As pid 1 we reap every orphan of the call; C's status is the call's.
    try:
      got, st = os.wait()
    except ChildProcessError:
      break
    if got == pid:
      status = st
  os.write(status_fd, f"status {status}\n".encode())
  os._exit(0)


def _call_process(req, workdir, reply_fd, status_fd, nested, uid, gid):
  """The server's child for one request: A when nested, else C itself."""
  if not nested:
    try:
      os.setpgid(0, 0)
    except OSError:
      pass
    _run_request(req, workdir, reply_fd, status_fd)
  try:
    _enter_call_namespaces(uid, gid)
  except OSError as e:
    _setup_failed(status_fd, e)
  pid = _fork_into(lambda: _call_init(req, workdir, reply_fd, status_fd), reply_fd)
  os.waitpid(pid, 0)  # Returns once every process of the call is gone.
  os._exit(0)


def _call_status(status_r, fallback_status):
  """(exit code as os.waitstatus_to_exitcode gives it, setup error or "")."""
  data = b""
  while True:
    try:
      chunk = os.read(status_r, 4096)
    except BlockingIOError:
      break
    if not chunk:
      break
    data += chunk
  text = data.decode("ascii", "replace").strip()
  if text.startswith("status ") and text[7:].lstrip("-").isdigit():
    return os.waitstatus_to_exitcode(int(text[7:])), ""
  if text.startswith("setup "):
    return None, text[6:]
  if fallback_status is not None:
    return os.waitstatus_to_exitcode(fallback_status), ""
  return None, "the call ended without a status"


def _nested_works(uid, gid):
  """Whether this kernel lets us build the per-call namespaces (probed once, at start)."""
  if _LIBC is None:
    return False
  pid = os.fork()
  if pid == 0:
    try:
      _enter_call_namespaces(uid, gid)
      inner = os.fork()
      if inner == 0:
        try:
          _confine(None)
        except OSError:
          os._exit(1)
        os._exit(0)
      _, st = os.waitpid(inner, 0)
      os._exit(0 if os.waitstatus_to_exitcode(st) == 0 else 1)
    except BaseException:
      os._exit(1)
  _, st = os.waitpid(pid, 0)
  return os.waitstatus_to_exitcode(st) == 0


# ---- leftovers, for the non-nested mode ----

def _parent_chain():
  chain, pid = set(), os.getpid()
  while pid > 1:
    try:
      with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
      break
    chain.add(pid)
  return chain


def _leftovers(uid, me, ancestors):
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    pid = int(name)
    if pid == me or pid in ancestors:
      continue
    try:  # The real uid from status: /proc/PID itself is root's for non-dumpable processes.
      with open(f"/proc/{name}/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
      real_uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
    except (OSError, KeyError, ValueError, IndexError):
      continue
    if real_uid == uid and state not in ("Z", "X"):  # Zombies are dead already.
      return True
  return False


def _reap():
  """Collects every exited child, orphans included (we are their subreaper)."""
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return


def _can_sweep(uid, ancestors):
  """Whether kill(-1) as our uid hits only the calls' processes: no ancestor but a pid
  namespace's init (which kill(-1) spares) runs as our uid."""
  for pid in ancestors:
    if pid == 1:
      continue
    try:
      with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
      if int(fields["Uid"].split()[0]) == uid:
        return False
    except (OSError, KeyError, ValueError, IndexError):
      return False  # Unreadable: assume it might be ours.
  return True


def _sweep():
  """SIGKILL to every process of our uid but ourselves, in one kernel pass."""
  try:
    os.kill(-1, signal.SIGKILL)
  except OSError:
    pass  # ESRCH: nothing else runs as our uid.


def _dirty(uid, me, ancestors):
  """Whether a process of ours outlived its request (a just-killed one gets a moment)."""
  for delay in (0.0, 0.005, 0.02, 0.05):
    if delay:
      time.sleep(delay)
    _reap()
    if not _leftovers(uid, me, ancestors):
      return False
  return True


def _read_reply(fd, limit):
  """The reply pipe until EOF, or None past `limit` bytes (then it is closed unread)."""
  chunks, total = [], 0
  while True:
    data = os.read(fd, 65536)
    if not data:
      break
    total += len(data)
    if total > limit:
      return None
    chunks.append(data)
  return b"".join(chunks)


def serve():
  stdin = sys.stdin.buffer
  settings = json.loads(stdin.readline())
  control, workdir = int(settings["control_fd"]), settings["workdir"]
  check = settings["check_leftovers"] is True
  me, uid, gid = os.getpid(), os.getuid(), os.getgid()
  ancestors = _parent_chain()
  sweep = check and uid != 0 and _can_sweep(uid, ancestors)
  if _LIBC is not None:
    _LIBC.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # Orphans re-parent to us, not init.
  nested = settings["nested"] is True and _nested_works(uid, gid)
  _write_all(control, frame({"ready": True, "nested": nested}))
  while True:
    line = stdin.readline()
    if not line:
      os._exit(0)
    req = json.loads(line)
    reply_r = reply_w = None
    if req.get("kind") == "calls":
      reply_r, reply_w = os.pipe()
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:
      os.close(control)
      os.close(status_r)
      if reply_r is not None:
        os.close(reply_r)
      _call_process(req, workdir, reply_w, status_w, nested, uid, gid)
    os.close(status_w)
    reply, oversized = None, False
    if reply_r is not None:
      os.close(reply_w)
      data = _read_reply(reply_r, int(req["max_reply_bytes"]))
      os.close(reply_r)
      oversized = data is None
      reply = data.decode("ascii", "replace") if data else None  # Nothing written: no reply.
    _, status = os.waitpid(pid, 0)
    dirty = False
    if not nested:
      try:
        os.killpg(pid, signal.SIGKILL)
      except OSError:
        pass
      if sweep:
        _sweep()
      dirty = _dirty(uid, me, ancestors) if check else (_reap() or False)
    os.set_blocking(status_r, False)
    code, setup_error = _call_status(status_r, None if nested else status)
    os.close(status_r)
    t = os.times()
    _write_all(control, frame({"id": req["id"], "code": code, "dirty": dirty,
                               "cpu_s": t.user + t.system, "reply": reply,
                               "reply_oversized": oversized, "setup_error": setup_error}))


if __name__ == "__main__":
  serve()
