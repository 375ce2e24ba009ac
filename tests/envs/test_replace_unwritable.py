"""A `replace` whose result cannot be written: an error observation, nothing changed or left.

A body holding a lone surrogate (legal in a Python str, not encodable as UTF-8) used to
raise UnicodeEncodeError after the temporary file was made, leaving a `.tmp-*` file in
the workspace and reaching the env's last-resort handler. The engine cleans actions
first (rollout/valid_text.py), but the env is also driven directly.
"""

import errno
import os

import pytest

from agentic_rl.envs import workspace as workspace_lib
from agentic_rl.envs.audit import AuditLog
from agentic_rl.envs.datasets import SweTaskSource
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.tool_call import format_tool_call as F
from agentic_rl.envs.workspace import FileToolError, Workspace
from tests.envs.conftest import env_config, isolation  # noqa: F401 (a fixture)


def _tree(root: str) -> dict:
  """relative path -> bytes (None for directories) of everything under `root`."""
  out = {}
  for d, dirs, files in os.walk(root):
    for name in dirs:
      out[os.path.relpath(os.path.join(d, name), root)] = None
    for name in files:
      with open(os.path.join(d, name), "rb") as f:
        out[os.path.relpath(os.path.join(d, name), root)] = f.read()
  return out


def test_a_surrogate_in_a_replace_body_is_an_error_and_leaves_nothing(isolation, tmp_path):
  task = SweTaskSource("train", tiers=("tiny",))[0]
  audit = AuditLog(str(tmp_path / "audit.jsonl"))
  with SweEnv(env_config(isolation), audit) as env:
    env.reset(task)
    root = env._sandbox.workspace.path
    before = _tree(root)
    r = env.step(F("replace", path=task.module_path, start=2, end=2,
                   text="    return 'ok'\n    # \udc80 \ud800"))
    assert r.observation == (f"error: cannot write {task.module_path}: the text is not valid "
                             "UTF-8 (lone surrogate at line 3)")
    assert r.info["decision"] == "error" and not r.done
    assert _tree(root) == before  # The module unchanged, no .tmp-* file, nothing new.
    # The episode goes on, and a writable edit still lands.
    r = env.step(F("replace", path=task.module_path, start=2, end=2, text="    return 0"))
    assert r.info["decision"] == "allowed", r.observation
    after = _tree(root)
    assert set(after) == set(before)
    assert after[task.module_path] != before[task.module_path]
  audit.close()


@pytest.fixture
def ws(tmp_path):
  w = Workspace(str(tmp_path / "root"))
  w.write_initial({"a.py": "x = 1\n"})
  yield w
  w.close()


def test_write_text_encodes_before_making_a_file(ws):
  with pytest.raises(FileToolError, match=r"^cannot write a\.py: the text is not valid UTF-8 "
                                          r"\(lone surrogate at line 2\)$"):
    ws.write_text("a.py", "x = 2\n'\udc80'\n")
  assert sorted(os.listdir(ws.path)) == ["a.py"]
  assert open(os.path.join(ws.path, "a.py")).read() == "x = 1\n"


def test_a_failed_write_removes_its_temporary_file(ws, monkeypatch):
  def full(fd, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(workspace_lib.os, "write", full)
  with pytest.raises(FileToolError, match=r"^cannot write a\.py: No space left on device$"):
    ws.write_text("a.py", "x = 2\n")
  monkeypatch.undo()
  assert sorted(os.listdir(ws.path)) == ["a.py"]
  assert open(os.path.join(ws.path, "a.py")).read() == "x = 1\n"
