"""Shared fixtures: env configs per isolation level, with short adversarial timeouts.

A test that needs an isolation guarantee this host cannot give (bubblewrap, per-call
namespaces) skips, saying why: unless AGENTIC_RL_REQUIRE_ISOLATION=1, which .ci/run sets
(CI installs bubblewrap and runs as root, so every guarantee must hold there), and then
it fails. An explicit switch rather than a guess from root and bwrap: a developer's root
container may refuse namespaces, and CI must not pass because a guarantee went missing.
"""

import functools
import os
import shutil

import pytest

from agentic_rl.envs.config import EnvSpec, default_env_config, validate_env_config
from agentic_rl.envs.sandbox import IsolationUnavailable, resolve_isolation


def env_config(isolation: str = "auto", timeout_s: float = 1.5, max_turns: int | None = None,
               process_signal_on_edit: bool | None = None, **overrides) -> EnvSpec:
  """The env spec with these sandbox settings; `a__b=v` overrides field a.b. The joined
  fields (max_turns, process_signal_on_edit) are passed as a run joins them."""
  c = default_env_config()
  c.sandbox.isolation = isolation
  c.sandbox.timeout_s = timeout_s
  for k, v in overrides.items():
    target = c
    *parents, leaf = k.split("__")
    for p in parents:
      target = target[p]
    target[leaf] = v
  return validate_env_config(c, max_turns=max_turns,
                             process_signal_on_edit=process_signal_on_edit)


@functools.lru_cache(maxsize=None)
def bubblewrap_skip_reason() -> str:
  if shutil.which("bwrap") is None:
    return "bubblewrap is not installed (apt-get install bubblewrap)"
  try:
    resolve_isolation(env_config("bubblewrap"))
  except IsolationUnavailable as e:
    return f"bwrap is installed but cannot create namespaces here: {e}"
  return ""


def isolation_required() -> bool:
  """Whether a missing isolation guarantee fails a test rather than skipping it."""
  return os.environ.get("AGENTIC_RL_REQUIRE_ISOLATION", "") not in ("", "0")


def skip_unless_required(reason: str) -> None:
  """Skips for `reason`, or fails where every guarantee is required (CI)."""
  if isolation_required():
    pytest.fail(f"{reason} (AGENTIC_RL_REQUIRE_ISOLATION is set: this guarantee must hold "
                "here)", pytrace=False)
  pytest.skip(reason)


ISOLATIONS = ["bubblewrap", "fallback"]


@pytest.fixture(params=ISOLATIONS)
def isolation(request):
  if request.param == "bubblewrap" and bubblewrap_skip_reason():
    skip_unless_required(bubblewrap_skip_reason())
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
