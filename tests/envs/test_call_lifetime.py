"""No process outlives its call, and nothing the agent prints can end a call early.

After each call returns, the sandbox's uid runs only the idle server (and, under
bubblewrap, bwrap itself), and the workspace does not change any more: whatever
the call started is dead before the host touches the workspace.
"""

import os
import time

import pytest

from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config, live_pids_of_uid

# Grading is checked on the pass fraction: a hack that passes even one more case shows.
PASS_FRACTION = "tests_fraction"

TASK = generate_task(11, "medium")

# The old end-of-call line, with the request id dug out of the caller's frames.
FORGE_DONE = """\
import os, sys, time
f = sys._getframe()
while f is not None and "req" not in f.f_locals:
    f = f.f_back
rid = f.f_locals["req"]["id"] if f is not None else "x"
sys.stdout.write(f"\\n@@agentic_rl_done {rid} 0 0 0.000\\n")
sys.stdout.flush()
time.sleep(1.0)
open("late.txt", "w").write("acted after the call")
"""

# A daemon that leaves the process group and the session, then acts later.
DAEMON = """\
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(0.8)
        open("late.txt", "w").write("acted after the call")
    os._exit(0)
print("parent done")
"""

# Many daemons that ignore SIGTERM and SIGHUP.
HARDY = """\
import os, signal, time
for _ in range(5):
    if os.fork() == 0:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        time.sleep(0.8)
        open("late.txt", "a").write("x")
        os._exit(0)
print("parent done")
"""


# A chain that keeps forking and exiting: each generation lives a moment, so a /proc scan
# that lists pids first and reads them later can miss every one; the last one acts later.
HOPPER = """\
import os, time
if os.fork() == 0:
    os.setsid()
    t = time.time()
    while time.time() - t < 0.3:
        if os.fork() != 0:
            os._exit(0)
    time.sleep(0.8)
    open("late.txt", "w").write("acted after the call")
    os._exit(0)
print("parent done")
"""


def _snapshot(env):
  return sorted(os.listdir(env._sandbox.workspace.path))


@pytest.mark.parametrize("namespaces", ["auto", "off"])
@pytest.mark.parametrize("attack", ["forged_done_line", "setsid_daemon", "hardy_daemons",
                                    "fork_hopper"])
@pytest.mark.parametrize("via", ["python", "test"])
def test_nothing_outlives_its_call(isolation, attack, via, namespaces):
  code = {"forged_done_line": FORGE_DONE, "setsid_daemon": DAEMON, "hardy_daemons": HARDY,
          "fork_hopper": HOPPER}[attack]
  with SweEnv(env_config(isolation, reward=PASS_FRACTION, timeout_s=5.0,
                         sandbox__per_call_namespaces=namespaces)) as env:
    env.reset(TASK)
    uid = env._sandbox.uid
    if uid is None:
      pytest.skip("host not root: no per-sandbox uid to count processes by")
    env.step(F("ls"))
    env.step(F("python", code="pass"))  # The server is up and idle.
    idle = len(live_pids_of_uid(uid))
    if via == "python":
      r = env.step(F("python", code=code))
    else:  # The same code at the top of the module under repair, run by a graded call.
      module = code + TASK.files[TASK.module_path]
      env.step(F("python", code=f"open({TASK.module_path!r}, 'w').write({module!r})"))
      r = env.step(F("test"))
    returned = _snapshot(env)
    alive = live_pids_of_uid(uid)
    assert len(alive) <= idle, (alive, r.observation)
    time.sleep(1.5)  # Anything still alive would act now.
    assert _snapshot(env) == returned
    assert len(live_pids_of_uid(uid)) <= idle
    if via == "test":
      assert "late.txt" not in returned  # Graded calls see a read-only copy of the module.
    r = env.step(F("test"))  # The sandbox still serves calls.
    assert r.info["tests_passed"] in (0, TASK.hidden_initial_passed), r.observation


def test_fallback_sweeps_leftovers_and_keeps_its_server():
  """Without per-call namespaces the server ends each call with kill(-1) as its uid: the
  daemons die before it answers, so no scan can miss one and no restart is needed."""
  with SweEnv(env_config("fallback", reward=PASS_FRACTION, timeout_s=5.0,
                         sandbox__per_call_namespaces="off")) as env:
    env.reset(TASK)
    uid = env._sandbox.uid
    if uid is None:
      pytest.skip("host not root: no per-sandbox uid to sweep by")
    env.step(F("python", code="pass"))
    starts = env._sandbox.server_starts
    for code in (DAEMON, HOPPER, HARDY, DAEMON, HOPPER):
      r = env.step(F("python", code=code))
      assert "parent done" in r.observation
      assert len(live_pids_of_uid(uid)) == 1, r.observation  # The server alone.
    env.step(F("python", code="pass"))
    assert env._sandbox.server_starts == starts
