"""The software-engineering environment: fix a generated repository until its tests pass.

Tools (grammar in agentic_rl/envs/tool_call.py, or with config.tool_format='json' the
native JSON calls of agentic_rl/envs/json_tool_call.py): ls, view, replace, test,
python, submit; each task's allowlist says which it may call. Every step is
one turn and one audit line, whatever the action was. Nothing the policy emits
raises out of `step`: malformed calls, unknown or denied tools, bad arguments,
paths outside the workspace, crashing or hostile code all become an error
observation and an audited decision.

Reward (`config.reward`, `episode_reward`) is graded on the task's hidden cases,
which the agent never sees; `test` runs and shows the visible ones, which the test
file documents (agentic_rl/envs/swe_tasks.py). By default it is the fraction of the
initially failing hidden tests that the submitted code repairs, net of tests it
breaks, floored at 0; tests the untouched repository already passed earn nothing, so
submitting without an edit earns 0 (`budget_end_reward` decides what an episode ended
by a budget gets: zero, or a fresh run of the module then). Process signal: after
every turn that changes or measures the code (replace, test, submit), the env knows
the fraction of hidden tests passing (a `test` reruns them only when the module's
bytes changed); info['process_signal'] is its change this turn, so over an episode
the signals sum to final minus initial fraction. With `process_signal_on_edit` a
replace triggers a hidden test run, so the credit lands on the edit that earned it.

Grading (agentic_rl/envs/grading.py) happens here, in the host: the cases and
their expected values never enter the sandbox. A graded run imports a staged
copy of the module under repair, alone, in a sandboxed process of its own,
calls each case's function on its inputs and returns the outputs as plain
data; the host compares them. The test file the agent can view documents the
cases and is restored before each run, but grading never reads it, so editing
the tests, shadowing modules, patching the runner, forging its output or
reading the expected values are not ways to pass them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
import weakref


from agentic_rl.envs import grading
from agentic_rl.envs.audit import AuditLog
from agentic_rl.envs.config import EnvSpec, validate_env_config
from agentic_rl.envs.env import StepResult
from agentic_rl.envs.permissions import PermissionPolicy
from agentic_rl.envs.sandbox import RunResult, Sandbox, resolve_isolation
from agentic_rl.envs.swe_tasks import SweTask
from agentic_rl.envs.json_tool_call import (EXAMPLE, json_usage, parse_json_tool_call,
                                            tool_schemas)
from agentic_rl.envs.tool_call import TOOL_SPECS, ToolCallError, parse_tool_call
from agentic_rl.envs.workspace import FileToolError, PathRefused

log = logging.getLogger(__name__)
_MAX_LISTED_FAILURES = 12
_QUOTA_SLACK_BYTES = 65536  # Less free than this in the workspace: say the quota is reached.
_NOT_RUN = RunResult(exit_code=None, stdout="", stderr="", stdout_bytes=0, stderr_bytes=0,
                     timed_out=False, output_limited=False, duration_s=0.0,
                     crashed="the module was not graded")
_NOT_MEASURED = dataclasses.replace(_NOT_RUN, crashed="")  # A reused hidden count.
_USAGE = {
    "ls": "ls", "view": "view PATH [START [END]]",
    "replace": "replace PATH START END + new lines", "test": "test",
    "python": "python + script lines", "submit": "submit"}


@dataclasses.dataclass
class _Outcome:
  observation: str
  decision: str = "allowed"
  reason: str = ""
  exit_code: int | None = None
  output_bytes: int = 0
  tests_passed: int | None = None  # Set when this turn measured the tests.
  submitted: bool = False


def bound_text(text: str, limit: int) -> tuple[str, bool]:
  """`text` cut to at most `limit` chars, saying so when cut."""
  if len(text) <= limit:
    return text, False
  marker = f"\n[output truncated: {{}} of {len(text)} chars shown]"
  keep = max(0, limit - len(marker.format(limit)))
  return text[:keep] + marker.format(keep), True


def episode_reward(mode: str, passed: int, initial_passed: int, total: int) -> float:
  """The reward of ending with `passed` of `total` tests passing, `initial_passed` at reset.

  repaired_fraction = max(0, newly passing - newly failing) / initially failing, and
  newly passing - newly failing = passed - initial_passed, whichever tests they are.
  """
  if mode == "tests_fraction":
    return passed / total
  if mode == "outcome" or initial_passed >= total:
    return float(passed == total)
  if mode == "repaired_fraction":
    return max(0, passed - initial_passed) / (total - initial_passed)
  raise ValueError(f"config.reward={mode!r}: expected repaired_fraction, tests_fraction "
                   f"or outcome.")


class SweEnv:
  """One trajectory at a time; see agentic_rl/envs/env.py for the protocol."""

  def __init__(self, config: EnvSpec | None = None, audit_log: AuditLog | None = None):
    self.config = validate_env_config(config)  # A built spec passes through unchecked.
    c = self.config
    self.audit = audit_log if audit_log is not None else AuditLog(
        None, max_arg_chars=c.audit_max_arg_chars)
    self._sandbox: Sandbox | None = None
    self._finalizer = None
    self._task: SweTask | None = None
    # JSON schemas of the task's tools with tool_format='json' (set by reset), for chat
    # templates that render them; None with the grammar.
    self.tools: list[dict] | None = None
    self.done = True
    self.trajectory_id = ""
    self.turn = 0
    self._tools = {"ls": self._ls, "view": self._view, "replace": self._replace,
                   "test": self._test, "python": self._python, "submit": self._submit}

  # ---- protocol ----

  @property
  def isolation(self) -> str:
    return resolve_isolation(self.config).level

  def reset(self, task: SweTask, trajectory_id: str | None = None) -> str:
    if not isinstance(task, SweTask):
      raise TypeError(f"SweEnv.reset needs a SweTask, got {type(task).__name__}")
    self._close_sandbox()
    self._sandbox = Sandbox(self.config)
    self._finalizer = weakref.finalize(self, self._sandbox.close)
    self._sandbox.workspace.write_initial(task.files)
    self._sandbox.prestart()  # Overlaps the sandbox's start-up with the policy's first turn.
    self._task = task
    self._policy = PermissionPolicy(task.allowlist)
    self.trajectory_id = trajectory_id or uuid.uuid4().hex[:16]
    self.turn = 0
    self.done = False
    self._t0 = time.monotonic()
    # The graded counts are the hidden cases': what reward and process signal measure.
    self.tests_total = task.num_hidden
    self.tests_passed = task.hidden_initial_passed
    module = task.files[task.module_path].encode("utf-8")
    self._hidden_key = (hashlib.sha256(module).hexdigest(), "")
    allowed = [t for t in _USAGE if t in task.allowlist]
    if self.config.tool_format == "json":
      self.tools = tool_schemas(allowed)
      tools = " | ".join(json_usage(TOOL_SPECS[t]) for t in allowed)
      call = EXAMPLE
    else:
      self.tools = None
      tools = " | ".join(_USAGE[t] for t in allowed)
      call = "<tool_call>NAME ARGS</tool_call>"
    obs = (f"Repository with failing tests. Fix the code so that all tests pass, then submit.\n"
           f"Tools: {tools}\nOne call per turn: {call}")
    return bound_text(obs, self.config.max_observation_chars)[0]

  def step(self, action_text: str) -> StepResult:
    if self._task is None:
      raise RuntimeError("SweEnv.step before reset()")
    if self.done:
      raise RuntimeError("SweEnv.step after the episode ended; call reset() for a new one")
    c = self.config
    self.turn += 1
    t_start = time.perf_counter()
    before = self.tests_passed
    tool, args = None, {}
    if time.monotonic() - self._t0 >= c.time_budget_s:
      out = _Outcome(f"time budget of {c.time_budget_s:g}s is used up; the action was not run",
                     decision="denied", reason="time budget exhausted")
      args = {"raw": action_text if isinstance(action_text, str) else repr(action_text)}
    else:
      parse = parse_json_tool_call if c.tool_format == "json" else parse_tool_call
      call = parse(action_text, max_call_chars=c.max_tool_call_chars,
                   max_body_chars=c.max_body_chars, max_path_chars=c.max_path_chars)
      if isinstance(call, ToolCallError):
        tool = call.tool
        args = {"raw": action_text if isinstance(action_text, str) else repr(action_text)}
        out = _Outcome(f"error: {call.message}", decision="error", reason=call.message)
      else:
        tool, args = call.name, call.args
        allowed, why = self._policy.check(tool)
        if not allowed:
          out = _Outcome(f"denied: {why}", decision="denied", reason=why)
        else:
          out = self._run_tool(tool, args)
    if out.tests_passed is not None:
      self.tests_passed = out.tests_passed

    end_reason, reward = None, 0.0
    if out.submitted:
      end_reason, reward = "submit", self._reward()
    elif out.reason == "time budget exhausted" or time.monotonic() - self._t0 >= c.time_budget_s:
      end_reason = "time_budget"
    elif self.turn >= c.max_turns:
      end_reason = "turn_budget"
    observation = out.observation
    if end_reason in ("time_budget", "turn_budget"):
      if c.budget_end_reward == "measured":
        # A fresh run of the module as it is now: a count from an earlier turn may be
        # stale (a `python` edit, a run that reported nothing), and a failed run pays 0.
        self.tests_passed = self._measure_hidden(reuse=False)[0]
        reward = self._reward()
      budget = "time" if end_reason == "time_budget" else "turn"
      suffix = f"\n[episode over: {budget} budget reached; reward {reward:.2f}]"
    else:
      suffix = ""
    observation, truncated = bound_text(observation, c.max_observation_chars - len(suffix))
    observation += suffix
    self.done = end_reason is not None
    duration = time.perf_counter() - t_start
    signal = (self.tests_passed - before) / self.tests_total
    entry = self.audit.record(
        trajectory_id=self.trajectory_id, turn=self.turn, tool=tool, args=args,
        decision=out.decision, reason=out.reason, exit_code=out.exit_code, duration_s=duration,
        output_bytes=out.output_bytes,
        output_sha256=hashlib.sha256(observation.encode("utf-8", "replace")).hexdigest(),
        extra={"tests_passed": self.tests_passed, "tests_total": self.tests_total,
               "end_reason": end_reason})
    info = {"tool": tool, "decision": out.decision, "reason": out.reason,
            "exit_code": out.exit_code,
            "process_signal": signal, "tests_passed": self.tests_passed,
            "tests_total": self.tests_total, "turn": self.turn, "duration_s": duration,
            "observation_truncated": truncated, "trajectory_id": self.trajectory_id,
            "audit_seq": entry["seq"], "isolation": self._sandbox.isolation}
    if self.done:
      info["end_reason"] = end_reason
    return StepResult(observation, float(reward), self.done, info)

  def _reward(self) -> float:
    return episode_reward(self.config.reward, self.tests_passed,
                          self._task.hidden_initial_passed, self.tests_total)

  def close(self) -> None:
    """Ends the episode and removes its workspace; never raises on what the agent did."""
    try:
      self._close_sandbox()
    except Exception:
      log.exception("closing the sandbox failed")
    self.done = True

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _close_sandbox(self) -> None:
    if self._finalizer is not None:
      self._finalizer()  # Runs Sandbox.close once: kills leftovers, removes the workspace.
      self._finalizer = None
    self._sandbox = None

  # ---- tools ----

  def _run_tool(self, tool: str, args: dict) -> _Outcome:
    try:
      out = self._tools[tool](**args)
    except PathRefused as e:
      return _Outcome(f"denied: {e}", decision="denied", reason=str(e))
    except FileToolError as e:
      return _Outcome(f"error: {e}", decision="error", reason=str(e))
    except Exception as e:  # A host-side failure; reported, logged, never raised into the rollout.
      log.exception("tool %s failed on the host", tool)
      why = f"tool failed on the host: {type(e).__name__}: {getattr(e, 'strerror', None) or e}"
      return _Outcome(f"error: {why}", decision="error", reason=why)
    note = self._quota_note()
    if note:  # First, so that truncating a long output cannot hide it.
      out.observation = f"{note}\n{out.observation}"
    return out

  def _oom_text(self) -> str:
    return (f"a process was killed at the sandbox's memory limit of "
            f"{self.config.sandbox.total_memory_mb} MiB, all its processes together")

  def _quota_note(self) -> str:
    try:
      usage = self._sandbox.workspace.usage()
    except OSError:
      return ""
    if usage is None or (usage[0] >= _QUOTA_SLACK_BYTES and usage[1] > 0):
      return ""
    s = self.config.sandbox
    return (f"[workspace quota reached: {s.disk_quota_mb} MiB and {s.max_files} files and "
            "directories in all; writes fail with 'No space left on device']")

  def _ls(self) -> _Outcome:
    entries, total = self._sandbox.workspace.list_files(50, self.config.max_file_bytes)
    text = "\n".join(entries) if entries else "(no files)"
    if total > len(entries):
      text += f"\n[{total - len(entries)} more entries not shown]"
    return _Outcome(text, output_bytes=len(text))

  def _read_lines(self, path: str) -> list[str]:
    text = self._sandbox.workspace.read_text(path, self.config.max_file_bytes)
    lines = text.split("\n")
    return lines[:-1] if text.endswith("\n") else lines

  def _view(self, path: str, start: int | None = None, end: int | None = None) -> _Outcome:
    lines = self._read_lines(path)
    n = len(lines)
    if n == 0:
      return _Outcome(f"{path} is empty", output_bytes=0)
    start = 1 if start is None else start
    if start < 1:
      return _Outcome("error: START must be >= 1", decision="error", reason="bad line range")
    if start > n:
      return _Outcome(f"error: START {start} is past the end of {path} ({n} lines)",
                      decision="error", reason="bad line range")
    if end is not None and end < start:
      return _Outcome(f"error: END {end} is before START {start}", decision="error",
                      reason="bad line range")
    last = min(n, end if end is not None else n, start + self.config.view_max_lines - 1)
    # Show whole lines only, as many as fit in one observation.
    budget = self.config.max_observation_chars - 60
    shown, size = [], 0
    for i in range(start, last + 1):
      row = f"{i}|{lines[i - 1]}"
      if size + len(row) + 1 > budget and shown:
        break
      shown.append(row)
      size += len(row) + 1
    last = start + len(shown) - 1
    text = f"{path} lines {start}-{last} of {n}:\n" + "\n".join(shown)
    return _Outcome(text, output_bytes=sum(len(x) + 1 for x in lines))

  def _replace(self, path: str, start: int, end: int, text: str) -> _Outcome:
    ws, task = self._sandbox.workspace, self._task
    editable = {ws.resolve(p) for p in task.editable}
    if ws.resolve(path) not in editable:
      why = f"{path} is read-only; editable: {', '.join(task.editable)}"
      return _Outcome(f"denied: {why}", decision="denied", reason=why)
    new_lines = [] if text == "" else text.split("\n")
    if len(new_lines) > self.config.max_replace_lines:
      return _Outcome(f"error: {len(new_lines)} lines, limit {self.config.max_replace_lines}",
                      decision="error", reason="too many lines")
    lines = self._read_lines(path)
    n = len(lines)
    if not 1 <= start <= n + 1 or not start - 1 <= end <= n:
      why = (f"bad range {start}-{end} for {path} ({n} lines): need 1 <= START <= {n + 1} "
             "and START-1 <= END <= " + str(n))
      return _Outcome(f"error: {why}", decision="error", reason="bad line range")
    updated = lines[: start - 1] + new_lines + lines[end:]
    ws.write_text(path, "\n".join(updated) + ("\n" if updated else ""))
    what = "inserted" if end == start - 1 else f"replaced lines {start}-{end} with"
    shown = "\n".join(f"{start + k}|{s}" for k, s in enumerate(new_lines[:10]))
    obs = (f"{path}: {what} {len(new_lines)} line(s); now {len(updated)} lines"
           + (f"\n{shown}" if shown else ""))
    out = _Outcome(obs, output_bytes=len(obs))
    if self.config.process_signal_on_edit:
      out.tests_passed, unread, r = self._measure_hidden(reuse=True)
      decision, why = self._run_decision(r)
      if decision != "allowed" or unread:  # The edit stands; the audit notes how its
        out.reason = f"hidden test run: {why or unread}"  # hidden run ended.
    return out

  def _module_source(self) -> tuple[bytes | None, str]:
    """(the module's bytes, or None when there is no module to import; why it cannot be
    graded at all, or "")."""
    task, ws = self._task, self._sandbox.workspace
    try:
      return ws.read_bytes(task.module_path, self.config.max_file_bytes), ""
    except FileToolError as e:
      if "limit" in str(e):  # Too large to grade: say so, rather than "no module".
        return None, f"the tests were not run: {e}"
      return None, ""  # Missing, a directory, not a regular file: graded as no module.
    except PathRefused:
      return None, ""  # A symlink out of the workspace: the module is not there.

  def _grade(self, cases, source: bytes | None, not_run: str) -> tuple[int, object, str, object]:
    """(passed, GradeReport or None, why there is no report, RunResult) of one graded run
    of `cases` on `source`. Never raises: whatever goes wrong, on either side, is a run
    that passed nothing and says why. The cases stay here; the sandbox gets their inputs
    and returns outputs as data."""
    if not_run:
      return 0, None, not_run, _NOT_RUN
    try:
      sb = self._sandbox
      try:  # The file the agent views documents the cases; grading does not read it.
        sb.workspace.restore_file(self._task.test_path, self._task.test_text)
      except (OSError, PathRefused, FileToolError) as e:
        log.warning("could not restore %s: %s", self._task.test_path, e)
      stage = sb.graded_stage_dir()  # Starts the server: per_call_namespaces is known after.
      nested = sb.per_call_namespaces
      if not nested:
        grading.stage_module(sb.stage_dir(), self._task.module_path, source)
      r = sb.request(grading.build_request(self._task, cases, source, self.config.sandbox,
                                           stage, send_source=nested))
    except Exception as e:  # A host-side failure: this run measured nothing.
      log.exception("a graded run failed on the host")
      return 0, None, f"the test run failed on the host: {type(e).__name__}", _NOT_RUN
    if r.reply is not None:
      try:
        report = grading.parse_reply(self._task, cases, r.reply,
                                     self.config.sandbox.max_value_chars)
        return min(len(cases), report.passed), report, "", r
      except grading.MalformedReply as e:
        return 0, None, f"its reply was unreadable: {e}", r
      except Exception as e:  # The decoder's contract is total; this is its last guard.
        log.exception("decoding a graded run's reply failed")
        return 0, None, f"its reply was unreadable: {type(e).__name__}", r
    if r.reply_oversized:
      return 0, None, "its reply was over the size of an honest one", r
    if r.timed_out:
      return 0, None, f"TIMEOUT: the tests did not finish in {self.config.sandbox.timeout_s:g}s", r
    return 0, None, ("killed: output limit exceeded" if r.output_limited
                     else f"killed: {self._oom_text()}" if r.oom_killed
                     else r.crashed or f"exit code {r.exit_code}"), r

  def _measure_tests(self) -> tuple[int, str, object]:
    """(passed, observation text, RunResult) of a run of the visible cases: what `test`
    shows, rendered as the old unittest runner printed it."""
    task = self._task
    total = len(task.cases)
    source, not_run = self._module_source()
    passed, report, why, r = self._grade(task.cases, source, not_run)
    if report is None:
      if r is _NOT_RUN and not_run:
        return 0, f"{why}\n0/{total} passed", r
      if why.startswith("TIMEOUT"):
        return 0, f"{why} (killed)\n0/{total} passed", r
      tail = (r.stderr or r.stdout).strip()[-300:]
      return 0, (f"the test run ended before reporting ({why})" + (f"\n{tail}" if tail else "")
                 + f"\n0/{total} passed"), r
    rows = []
    if report.import_error:
      rows.append(f"ERROR importing {task.test_path}: {report.import_error}")
    bad = [x for x in report.results if x.status != "pass"]
    for x in bad[:_MAX_LISTED_FAILURES]:
      if x.status == "fail":
        rows.append(f"FAIL {x.call}: got {x.got}, want {x.want}")
      else:
        where = f" ({x.where})" if x.where else ""
        rows.append(f"ERROR {x.call}: {x.error}{where}")
    if len(bad) > _MAX_LISTED_FAILURES:
      rows.append(f"... and {len(bad) - _MAX_LISTED_FAILURES} more failing")
    if report.output:
      rows.append("output of the code under test:\n" + report.output)
    rows.append(f"all {total} tests passed" if passed == total else f"{passed}/{total} passed")
    return passed, "\n".join(rows), r

  def _measure_hidden(self, reuse: bool) -> tuple[int, str, object]:
    """(passed, why the run reported nothing or "", RunResult) of a run of the hidden
    cases, which the reward grades. With `reuse`, a module byte-identical to the one last
    measured keeps that count (nothing is run)."""
    source, not_run = self._module_source()
    key = (hashlib.sha256(source).hexdigest() if source is not None else None, not_run)
    if reuse and key == self._hidden_key:
      return self.tests_passed, "", _NOT_MEASURED
    passed, report, why, r = self._grade(self._task.hidden_cases, source, not_run)
    self._hidden_key = key
    if report is not None and report.import_error:
      why = f"ERROR importing the module: {report.import_error}"
    return passed, why, r

  @staticmethod
  def _run_decision(r) -> tuple[str, str]:
    if r.timed_out:
      return "timeout", "wall-clock timeout"
    if r.output_limited:
      return "error", "output limit exceeded"
    if r.crashed:
      return "error", r.crashed
    return "allowed", ""

  def _test(self) -> _Outcome:
    _, text, r = self._measure_tests()
    decision, reason = self._run_decision(r)
    hidden, _, _ = self._measure_hidden(reuse=True)  # Runs only if the module changed.
    return _Outcome(text, decision=decision, reason=reason, exit_code=r.exit_code,
                    output_bytes=r.stdout_bytes + r.stderr_bytes, tests_passed=hidden)

  def _python(self, code: str) -> _Outcome:
    r = self._sandbox.request({"kind": "python", "code": code})
    out = (r.stdout + (("\n" if r.stdout and not r.stdout.endswith("\n") else "") + r.stderr
                       if r.stderr else "")).rstrip("\n")
    decision, reason = self._run_decision(r)
    if r.timed_out:
      head = f"timeout: killed after {self.config.sandbox.timeout_s:g}s"
    elif r.output_limited:
      head = f"killed: wrote over {self.config.sandbox.output_kill_bytes} bytes of output"
    elif r.oom_killed:
      head = f"exit code {r.exit_code}; killed: {self._oom_text()}"
    elif r.crashed:
      head = f"killed: {r.crashed}"
    else:
      head = f"exit code {r.exit_code}"
    return _Outcome(head + ("\n" + out if out else ""), decision=decision, reason=reason,
                    exit_code=r.exit_code, output_bytes=r.stdout_bytes + r.stderr_bytes)

  def _submit(self) -> _Outcome:
    passed, why, r = self._measure_hidden(reuse=False)
    total = self._task.num_hidden
    reward = episode_reward(self.config.reward, passed, self._task.hidden_initial_passed, total)
    # The hidden cases stay hidden: no row of theirs is shown, only how the run went.
    obs = f"submitted: {passed}/{total} hidden tests pass (reward {reward:.2f})"
    if why:
      obs += f"\nthe hidden test run ended before reporting ({why})"
    decision, reason = self._run_decision(r)
    return _Outcome(obs, decision=decision, reason=reason, exit_code=r.exit_code,
                    output_bytes=r.stdout_bytes + r.stderr_bytes, tests_passed=passed,
                    submitted=True)
