"""The permission policy: which tools a task may call.

Each task carries an allowlist; a call to a tool outside it is refused with an
observation naming the allowed tools, and audited as 'denied'. Path-level
rules (workspace confinement, read-only test files) are enforced by the
workspace and the env and audited the same way.
"""

from __future__ import annotations

from agentic_rl.envs.config import ALL_TOOLS


class PermissionPolicy:
  def __init__(self, allowlist):
    allow = tuple(allowlist)
    unknown = [t for t in allow if t not in ALL_TOOLS]
    if unknown:
      raise ValueError(f"allowlist names unknown tools {unknown}; tools: {ALL_TOOLS}")
    self.allowlist = allow

  def check(self, tool: str) -> tuple[bool, str]:
    """(allowed, reason shown to the agent when not)."""
    if tool in self.allowlist:
      return True, ""
    allowed = ", ".join(self.allowlist)
    return False, f"tool {tool!r} is not allowed for this task; allowed: {allowed}"
