"""Bounded in total, not per file: the episode's disk quota (bytes and files), the sized
/tmp and /dev/shm inside the memory budget, and output per call. Exceeding any of them
tells the agent so and leaves the host unchanged."""

import os
import shutil

import pytest

from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config

TASK = generate_task(11, "medium")
MIB = 1 << 20

FILL = """\
import os
written, err = 0, ""
try:
    for i in range(10000):
        with open(os.path.join(%(dir)r, f"fill{i}.bin"), "wb") as f:
            for _ in range(%(per_file)d):
                f.write(b"x" * (1 << 20))
                written += 1 << 20
except OSError as e:
    err = e.strerror
print("written", written, "error", err)
"""

MANY_FILES = """\
import os
made, err = 0, ""
try:
    for i in range(100000):
        os.mkdir(f"d{i}") if i % 2 else open(f"f{i}", "w").close()
        made += 1
except OSError as e:
    err = e.strerror
print("made", made, "error", err)
"""


def _written(obs: str) -> tuple[int, str]:
  line = next(l for l in obs.split("\n") if l.startswith("written "))
  _, n, _, *err = line.split(" ")
  return int(n), " ".join(err)


def _env(isolation, **kw):
  return SweEnv(env_config(isolation, timeout_s=20.0, **kw))


def test_workspace_bytes_are_bounded_per_episode(isolation):
  if os.geteuid() != 0:
    pytest.skip("the per-episode quota needs root (a tmpfs per workspace)")
  host_free = shutil.disk_usage("/tmp").free
  with _env(isolation) as env:
    env.reset(TASK)
    quota = env.config.sandbox.disk_quota_mb * MIB
    # Files of 4 MiB stay under the per-file limit (8 MiB); their sum may not pass the quota.
    r = env.step(F("python", code=FILL % {"dir": ".", "per_file": 4}))
    n, err = _written(r.observation)
    assert n <= quota and err == "No space left on device", r.observation
    assert r.observation.startswith("[workspace quota reached:"), r.observation
    r = env.step(F("test"))  # Grading does not need room in the workspace.
    assert r.info["tests_passed"] == TASK.hidden_initial_passed, r.observation
    ws = env._sandbox.workspace.path
  assert not os.path.exists(ws)
  assert shutil.disk_usage("/tmp").free > host_free - 8 * MIB  # Nothing landed on the host.


def test_workspace_file_count_is_bounded_per_episode(isolation):
  if os.geteuid() != 0:
    pytest.skip("the per-episode quota needs root (a tmpfs per workspace)")
  with _env(isolation, sandbox__max_files=300) as env:
    env.reset(TASK)
    r = env.step(F("python", code=MANY_FILES))
    line = next(l for l in r.observation.split("\n") if l.startswith("made "))
    made = int(line.split()[1])
    assert made <= 300 and "No space left on device" in line, r.observation
    assert r.observation.startswith("[workspace quota reached:")
    r = env.step(F("ls"))  # Listing a full workspace is bounded and works.
    assert r.info["decision"] == "allowed"


@pytest.mark.parametrize("target", ["/tmp", "/dev/shm", "/dev"])
def test_ram_backed_mounts_are_sized(isolation, target):
  if isolation == "fallback":
    pytest.skip("the fallback has no mount namespace: /tmp and /dev/shm are the host's "
                "(listed in its warning)")
  with _env(isolation) as env:
    env.reset(TASK)
    s = env.config.sandbox
    r = env.step(F("python", code=FILL % {"dir": target, "per_file": 1}))
    n, err = _written(r.observation)
    limit = {"/tmp": s.tmpfs_mb, "/dev/shm": s.shm_mb, "/dev": 0}[target] * MIB
    assert n <= limit and err in ("No space left on device", "Read-only file system"), \
        r.observation
    # What they may hold is taken off the address-space limit: one process plus both
    # mounts stay within memory_mb.
    r = env.step(F("python", code="import resource\n"
                                  "print('as', resource.getrlimit(resource.RLIMIT_AS)[0])"))
    as_limit = int(r.observation.split("as ")[1].split()[0])
    assert as_limit + (s.tmpfs_mb + s.shm_mb) * MIB == s.memory_mb * MIB


def test_config_rejects_mounts_larger_than_the_memory_budget():
  memory_mb = env_config().sandbox.memory_mb
  with pytest.raises(ValueError, match="config.env.sandbox.tmpfs_mb"):
    env_config(sandbox__tmpfs_mb=memory_mb)
  with pytest.raises(ValueError, match="config.env.sandbox.disk_quota_mb"):
    env_config(sandbox__disk_quota_mb=env_config().sandbox.file_size_mb - 1)


# Four processes, each holding 400 MiB in memfds written with write(): under RLIMIT_AS
# each is fine (the pages are in no mapping); together they pass total_memory_mb.
MEMFD_HOARD = """\
import os, time
def hold(mib):
    fds = []
    for i in range(mib // 8):
        fd = os.memfd_create(f"m{i}")
        for _ in range(8):
            os.write(fd, b"x" * (1 << 20))
        fds.append(fd)
    return fds
kids = []
for k in range(4):
    pid = os.fork()
    if pid == 0:
        hold(400)
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
print("children", [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids])
"""


def test_memory_is_bounded_in_total(isolation):
  from agentic_rl.envs import cgroup
  if cgroup.parent() is None:
    pytest.skip("no writable memory cgroup here (listed in the sandbox's warning)")
  with _env(isolation, sandbox__total_memory_mb=768) as env:
    env.reset(TASK)
    r = env.step(F("python", code=MEMFD_HOARD))
    assert "memory limit of 768 MiB" in r.observation, r.observation
    r = env.step(F("test"))  # The sandbox still serves, the grader is unharmed.
    assert r.info["tests_passed"] == TASK.hidden_initial_passed, r.observation
    path = env._sandbox._cgroup.path
  import os as _os
  assert not _os.path.exists(path)  # Removed with the sandbox.
