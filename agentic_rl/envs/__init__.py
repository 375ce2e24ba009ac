"""Host tool environments: a sandbox, a permission policy, an audit log and an SWE task suite.

`SweTaskSource` / `swe_task_dataset` are imported on first use: they need grain,
whose import takes seconds, and the audit CLI and the sandbox do not.
"""

from agentic_rl.envs.audit import AuditLog, verify_audit_log
from agentic_rl.envs.config import default_env_config, validate_env_config
from agentic_rl.envs.env import END_REASONS, Env, StepResult
from agentic_rl.envs.expert import ExpertResult, play_expert
from agentic_rl.envs.sandbox import IsolationUnavailable, Sandbox, resolve_isolation
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import Bug, SweTask, generate_task
from agentic_rl.envs.tool_call import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, ToolCallError,
                                       format_tool_call, parse_tool_call)

_LAZY = {"SweTaskSource", "swe_task_dataset"}


def __getattr__(name):
  if name in _LAZY:
    from agentic_rl.envs import datasets
    return getattr(datasets, name)
  raise AttributeError(f"module 'agentic_rl.envs' has no attribute {name!r}")


__all__ = [
    "AuditLog", "verify_audit_log", "default_env_config", "validate_env_config", "SweTaskSource",
    "swe_task_dataset", "END_REASONS", "Env", "StepResult", "ExpertResult", "play_expert",
    "IsolationUnavailable", "Sandbox", "resolve_isolation", "SweEnv", "Bug", "SweTask",
    "generate_task", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ToolCall", "ToolCallError",
    "format_tool_call", "parse_tool_call",
]
