"""The program that runs inside the sandbox: a fork server for test runs and scripts.

Started as `python -I -S -B -c <this source> WORKDIR CHECK_LEFTOVERS` (the
host sends the source, so nothing is read from the workspace). It imports the
stdlib it needs once, before the workspace is on sys.path, prints READY, and
then serves one JSON request per stdin line. Each request runs in a forked
child (its own process group, stdin from /dev/null), so every run starts from
a clean interpreter that has never imported workspace code, without paying
Python's start-up and `import unittest` again. The server is the subreaper
of its children (orphans re-parent to it, not to the host's init). After the
child exits it kills the child's process group, reaps, checks whether any
other process of its uid survived (CHECK_LEFTOVERS=1) and prints
"\\n" + DONE_PREFIX + "<id> <exit status> <dirty 0|1> <server cpu seconds>".
On a timeout or too much output the host kills the request's processes (all
of the sandbox's, or all but the server where it can tell them apart) and
the server reports and reaps as usual; a dirty run ends the whole sandbox.

Requests:
  {"id", "kind": "tests", "test_module", "max_repr", "max_output"}
      Runs the test module with unittest and prints RESULT_PREFIX + id + JSON:
      per subtest pass, fail (the got/want given to assertEqual) or error
      (exception and the workspace file:line it came from); prints of the code
      under test are captured. .pyc files in the workspace are never loaded. A
      subtest passes only if assertEqual ran on values that are `plain_equal`.
  {"id", "kind": "python", "code"}
      Runs `code` as `python -` would (cwd on sys.path, __name__ == "__main__").

Not a security boundary: code under test runs in the child that reports on
it. The sandbox contains it; the id keeps ordinary output from being taken for
a result, and plain_equal stops the cheap reward hacks (an always-equal
object, a no-op assertEqual); code that digs the id out of this process's
memory to forge a report is not stopped.
"""

import contextlib
import importlib
import io
import json
import os
import signal
import sys
import time
import traceback
import types
import unittest

READY = "@@agentic_rl_ready"
DONE_PREFIX = "@@agentic_rl_done "
RESULT_PREFIX = "@@agentic_rl_result "


_PLAIN_SCALARS = (int, bool, float, str, bytes, type(None))


def plain_equal(got, want):
  """Equality of plain data, types included: an object whose __eq__ always says True, a
  str subclass, or 1 for True does not pass. Expected values are literals, so this is
  what "equal" means for a test here."""
  if type(got) is not type(want):
    return False
  if type(want) in (list, tuple):
    return len(got) == len(want) and all(plain_equal(a, b) for a, b in zip(got, want))
  if type(want) is dict:
    return (len(got) == len(want) and all(type(k) in _PLAIN_SCALARS for k in got)
            and all(k in want and plain_equal(got[k], want[k]) for k in got))
  if type(want) in _PLAIN_SCALARS:
    return got == want
  return False


def _short_repr(value, limit):
  try:
    r = repr(value)
  except Exception as e:  # A hostile __repr__ must not break the report.
    r = f"<unrepresentable {type(value).__name__}: {type(e).__name__}>"
  return r if len(r) <= limit else r[: limit - 3] + "..."


def _where(tb, workdir):
  frames = [f for f in traceback.extract_tb(tb) if f.filename.startswith(workdir + os.sep)]
  if not frames:
    return ""
  return f"{os.path.relpath(frames[-1].filename, workdir)}:{frames[-1].lineno}"


def _describe_error(exc, workdir, limit):
  if isinstance(exc, SyntaxError):
    return f"SyntaxError: {exc.msg}", f"{os.path.basename(exc.filename or '?')}:{exc.lineno}"
  try:
    msg = str(exc)
  except Exception:
    msg = ""
  return f"{type(exc).__name__}: {msg[:limit]}".rstrip(": "), _where(exc.__traceback__, workdir)


def run_tests(req, workdir):
  max_repr, max_output = int(req["max_repr"]), int(req["max_output"])
  last_eq = {}
  original_eq = unittest.TestCase.assertEqual

  def recording_eq(self, first, second, msg=None):
    last_eq["got"], last_eq["want"] = first, second
    return original_eq(self, first, second, msg)

  unittest.TestCase.assertEqual = recording_eq
  results = []
  had_subtests = set()

  def record(test, params, err, kind):
    name = getattr(test, "_testMethodName", str(test))
    func = name[5:] if name.startswith("test_") else name
    args = ", ".join(_short_repr(v, max_repr) for v in (params or {}).values())
    entry = {"test": name, "call": f"{func}({args})", "status": "pass"}
    if err is None and params is not None and not (
        "got" in last_eq and plain_equal(last_eq["got"], last_eq["want"])):
      # unittest says pass, but no assertEqual of plain equal values ran (assertEqual or
      # __eq__ tampered with): not a pass.
      entry.update(status="fail", got=_short_repr(last_eq.get("got", "<no assertEqual>"),
                                                  max_repr),
                   want=_short_repr(last_eq.get("want", "<no assertEqual>"), max_repr))
    elif err is not None:
      if kind == "fail" and "got" in last_eq:
        entry.update(status="fail", got=_short_repr(last_eq["got"], max_repr),
                     want=_short_repr(last_eq["want"], max_repr))
      else:
        text, where = _describe_error(err[1], workdir, max_repr)
        entry.update(status="error", error=text, where=where)
    last_eq.clear()
    results.append(entry)

  class Result(unittest.TestResult):
    def addSubTest(self, test, subtest, err):
      had_subtests.add(id(test))
      fail = err is not None and issubclass(err[0], test.failureException)
      record(test, subtest.params, err, "fail" if fail else "error")
      super().addSubTest(test, subtest, err)

    def addSuccess(self, test):
      if id(test) not in had_subtests:
        record(test, None, None, "")

    def addFailure(self, test, err):
      record(test, None, err, "fail")

    def addError(self, test, err):
      record(test, None, err, "error")

  captured = io.StringIO()
  import_error = None
  with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
    try:
      module = importlib.import_module(req["test_module"])
    except BaseException as e:  # SyntaxError, SystemExit at import, ...: all reported.
      text, where = _describe_error(e, workdir, max_repr)
      import_error = f"{text} ({where})" if where else text
    else:
      try:
        unittest.defaultTestLoader.loadTestsFromModule(module).run(Result())
      except BaseException as e:
        text, where = _describe_error(e, workdir, max_repr)
        import_error = f"test run aborted: {text}" + (f" ({where})" if where else "")
  report = {"results": results, "import_error": import_error,
            "output": captured.getvalue()[:max_output]}
  line = RESULT_PREFIX + req["id"] + " " + json.dumps(report) + "\n"
  os.write(1, line.encode("utf-8", errors="replace"))
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


def _child(req, workdir, own_group):
  if own_group:  # Else stay in the server's group: the host kills that group after the run.
    try:
      os.setpgid(0, 0)
    except OSError:
      pass
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  sys.stdin = open(0, closefd=False)
  signal.signal(signal.SIGPIPE, signal.SIG_DFL)
  sys.dont_write_bytecode = True
  # Bytecode is looked up under a prefix that does not exist: planted .pyc files are ignored.
  sys.pycache_prefix = "/nonexistent/agentic_rl_pycache"
  code = 1
  try:
    if req.get("kind") == "tests":
      sys.path.insert(0, workdir)
      code = run_tests(req, workdir)
    elif req.get("kind") == "python":
      code = run_script(req)
    else:
      print(f"unknown request kind {req.get('kind')!r}", file=sys.stderr)
  finally:
    for f in (sys.stdout, sys.stderr):
      try:
        f.flush()
      except BaseException:
        pass
    os._exit(code)


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


def _dirty(uid, me, ancestors):
  """Whether a process of ours outlived its request (a just-killed one gets a moment)."""
  for delay in (0.0, 0.005, 0.02, 0.05):
    if delay:
      time.sleep(delay)
    _reap()
    if not _leftovers(uid, me, ancestors):
      return False
  return True


def _become_subreaper():
  """Orphans of a request re-parent to us, not to the host's init, so we can reap them."""
  try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
  except Exception:  # No ctypes in this interpreter: orphans go to init, as usual.
    return False


def serve():
  workdir, check = sys.argv[1], sys.argv[2] == "1"
  me, uid = os.getpid(), os.getuid()
  ancestors = _parent_chain()
  _become_subreaper()
  os.write(1, (READY + "\n").encode())
  stdin = sys.stdin.buffer
  while True:
    line = stdin.readline()
    if not line:
      os._exit(0)
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
      _child(req, workdir, own_group=check)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if check:
      try:
        os.killpg(pid, signal.SIGKILL)
      except OSError:
        pass
    dirty = _dirty(uid, me, ancestors) if check else (_reap() or False)
    t = os.times()
    done = f"\n{DONE_PREFIX}{req['id']} {code} {int(dirty)} {t.user + t.system:.3f}\n"
    os.write(1, done.encode())


if __name__ == "__main__":
  serve()
