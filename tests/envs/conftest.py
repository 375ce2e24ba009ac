"""Shared fixtures: env configs per isolation level, with short adversarial timeouts."""

import functools
import os
import shutil

import pytest

from agentic_rl.envs.config import default_env_config
from agentic_rl.envs.sandbox import IsolationUnavailable, resolve_isolation


def env_config(isolation: str = "auto", timeout_s: float = 1.5, **overrides):
  c = default_env_config()
  c.sandbox.isolation = isolation
  c.sandbox.timeout_s = timeout_s
  for k, v in overrides.items():
    target = c
    *parents, leaf = k.split("__")
    for p in parents:
      target = target[p]
    target[leaf] = v
  return c


@functools.lru_cache(maxsize=None)
def bubblewrap_skip_reason() -> str:
  if shutil.which("bwrap") is None:
    return "bubblewrap is not installed (apt-get install bubblewrap)"
  try:
    resolve_isolation(env_config("bubblewrap"))
  except IsolationUnavailable as e:
    return f"bwrap is installed but cannot create namespaces here: {e}"
  return ""


ISOLATIONS = [
    pytest.param("bubblewrap", id="bubblewrap",
                 marks=pytest.mark.skipif(bool(bubblewrap_skip_reason()),
                                          reason=bubblewrap_skip_reason() or "n/a")),
    pytest.param("fallback", id="fallback"),
]


@pytest.fixture(params=ISOLATIONS)
def isolation(request):
  return request.param


def live_pids_of_uid(uid: int) -> list[int]:
  """Live (non-zombie) processes whose real uid is `uid`, read from /proc/PID/status."""
  out = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    except OSError:
      continue
    if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in ("Z", "X"):
      out.append(int(name))
  return out
