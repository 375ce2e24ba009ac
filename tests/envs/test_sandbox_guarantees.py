"""Guarantees are claimed per sandbox, not per host: a sandbox that cannot get what its
host gives every other (its own memory cgroup) does not start, or, where the config
allows it, starts without and says so in its own missing_guarantees."""

import os
import shutil
import subprocess
import tempfile
import time

import pytest

from agentic_rl.envs import cgroup, sandbox
from agentic_rl.envs.sandbox import IsolationUnavailable, Sandbox
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config, live_pids_of_uid, skip_unless_required

TASK = generate_task(3, "medium")
NO_CGROUP = "no memory cgroup"


@pytest.fixture
def failing_cgroups(monkeypatch, tmp_path):
  """A host where memory cgroups can be made (so the probe claims them), but no sandbox's
  own can: its parent directory is gone, as a revoked or exhausted hierarchy would fail."""
  monkeypatch.setattr(cgroup, "parent", lambda: (2, str(tmp_path / "gone")))
  monkeypatch.setattr(sandbox, "_iso_cache", {})  # Probe again, under that host.


@pytest.fixture
def ws_root():
  """A workspace root of this test's own, that the sandbox uid may traverse."""
  root = tempfile.mkdtemp(prefix="agentic_rl_guarantees_")
  os.chmod(root, 0o755)
  yield root
  shutil.rmtree(root, ignore_errors=True)


def _config(isolation, root, memory_cgroup):
  # One uid only (its own per test process): a uid a failed start leaked would make the
  # next sandbox fail to get one.
  return env_config(isolation, sandbox__memory_cgroup=memory_cgroup,
                    sandbox__workspace_root=root, sandbox__uid_base=400_000 + os.getpid(),
                    sandbox__uid_count=1)


def _workspaces(root) -> list[str]:
  return [os.path.join(d, e) for d, _, names in os.walk(root) for e in names
          if e.startswith("ep-")]


def test_a_sandbox_whose_cgroup_cannot_be_made_does_not_start(isolation, failing_cgroups,
                                                               ws_root):
  c = _config(isolation, ws_root, "auto")
  assert sandbox.resolve_isolation(c).memory_cgroup  # The host claims them.
  with SweEnv(c) as env:
    with pytest.raises(IsolationUnavailable, match="memory cgroup.*best_effort"):
      env.reset(TASK)
  # Nothing left behind: no workspace, no uid lease (the one uid is free again).
  assert _workspaces(ws_root) == []
  with Sandbox(_config(isolation, ws_root, "best_effort")) as sb:
    assert any(m.startswith(NO_CGROUP) for m in sb.missing_guarantees)


def test_best_effort_runs_without_its_cgroup_and_says_so(isolation, failing_cgroups,
                                                         ws_root, caplog):
  c = _config(isolation, ws_root, "best_effort")
  with caplog.at_level("WARNING", logger="agentic_rl.envs.sandbox"):
    with SweEnv(c) as env:
      env.reset(TASK)
      missing = env._sandbox.missing_guarantees
      r = env.step(F("test"))
  assert "this sandbox runs without a memory cgroup" in caplog.text
  assert any(m.startswith(NO_CGROUP) for m in missing), missing
  assert "passed" in r.observation, r.observation  # It runs, graded as any other.


def test_a_sandbox_claims_the_cgroup_it_has(isolation):
  if cgroup.parent() is None:
    pytest.skip("no writable memory cgroup here (listed in the sandbox's warning)")
  with Sandbox(env_config(isolation)) as sb:
    assert sb._cgroup is not None
    assert not any(m.startswith(NO_CGROUP) for m in sb.missing_guarantees)
  with Sandbox(env_config(isolation, sandbox__memory_cgroup="off")) as sb:
    assert sb._cgroup is None
    assert any(m.startswith(NO_CGROUP) for m in sb.missing_guarantees)


def test_kill_all_ends_the_uid_s_processes_without_forking_the_host(isolation, monkeypatch):
  """kill_all drops to the sandbox uid in setpriv: Popen(user=/group=) would make CPython
  fork() the host (copying a trainer's page tables) where a plain spawn uses vfork."""
  with Sandbox(env_config(isolation)) as sb:
    if sb.uid is None:
      skip_unless_required("no uid drop here (not root): kill_all has nothing to do")
    setpriv = shutil.which("setpriv")
    sleeper = subprocess.Popen([setpriv, f"--reuid={sb.uid}", f"--regid={sb.uid}",
                                "--clear-groups", "--", "sleep", "30"])
    for _ in range(500):  # Until setpriv has dropped to the uid.
      if sleeper.pid in live_pids_of_uid(sb.uid):
        break
      time.sleep(0.01)
    assert sleeper.pid in live_pids_of_uid(sb.uid)
    spawned = []
    real_run = subprocess.run

    def spy(*args, **kwargs):
      spawned.append(kwargs)
      return real_run(*args, **kwargs)
    monkeypatch.setattr(subprocess, "run", spy)
    sb.kill_all()
    assert sleeper.wait(timeout=5) == -9
    assert spawned and not any({"user", "group", "extra_groups", "preexec_fn"} & set(k)
                               for k in spawned)
    assert not live_pids_of_uid(sb.uid)
