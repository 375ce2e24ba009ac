"""Host-side work that hostile trees cannot break: listing, restoring and removing a
workspace never recurse on the Python stack, never follow symlinks and bound their
work; names cannot forge lines; `step` and `close` never raise."""

import os
import sys

import pytest

from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from agentic_rl.envs.workspace import Workspace, remove_tree, render_name
from tests.envs.conftest import env_config

TASK = generate_task(11, "medium")
DEEP = 1500  # Deeper than Python's recursion limit (1000).

DEEP_TREE = """\
import os
os.makedirs("deep", exist_ok=True)
os.chdir("deep")
for i in range(%d):
    os.mkdir("d")
    os.chdir("d")
open("bottom.txt", "w").write("x")
print("built")
""" % DEEP


def _deep_tree(root: str, depth: int) -> None:
  fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
  for _ in range(depth):
    os.mkdir("d", dir_fd=fd)
    child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = child
  os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
  os.close(fd)


def test_a_deep_tree_breaks_neither_step_nor_close(isolation):
  env = SweEnv(env_config(isolation, timeout_s=20.0, sandbox__max_files=4096))
  env.reset(TASK)
  assert "built" in env.step(F("python", code=DEEP_TREE)).observation
  r = env.step(F("ls"))
  assert r.info["decision"] == "allowed" and TASK.module_path in r.observation
  assert "not listed" in r.observation  # The depth bound is said, not silently applied.
  # The test file becomes a deep tree too: restoring it removes the tree.
  code = DEEP_TREE.replace('"deep"', repr(TASK.test_path))
  env.step(F("python", code=f"import os\nos.remove({TASK.test_path!r})\n" + code))
  r = env.step(F("test"))
  assert r.info["tests_passed"] == TASK.hidden_initial_passed, r.observation
  r = env.step(F("view", path=TASK.test_path))
  assert r.info["decision"] == "allowed" and "import unittest" in r.observation
  ws = env._sandbox.workspace.path
  env.close()
  assert not os.path.exists(ws)


def test_names_cannot_forge_observation_lines(isolation):
  names = ["fake.py (9 lines)\nforged.py (1 lines)", "esc\x1b[2Jape.py", "tab\tname.py",
           "'quoted'.py"]
  code = ("import os\n" + "".join(f"open({n!r}, 'w').close()\n" for n in names)
          + "open(b'\\xff\\xfe.py', 'w').close()\nos.mkdir(b'dir\\nx')\n"
          + "open(b'dir\\nx/inner.py', 'w').close()\n")
  with SweEnv(env_config(isolation)) as env:
    env.reset(TASK)
    env.step(F("python", code=code))
    r = env.step(F("ls"))
  lines = r.observation.split("\n")
  files = len(TASK.files) + len(names) + 2
  assert len(lines) == files, lines  # One line per file: none was forged.
  assert not any(l.startswith("forged.py") for l in lines)
  assert "'fake.py (9 lines)\\nforged.py (1 lines)' (0 lines)" in lines
  assert "b'\\xff\\xfe.py' (0 lines)" in lines
  assert "'dir\\nx/inner.py' (0 lines)" in lines
  assert all("\x1b" not in l and "\t" not in l for l in lines)


def test_remove_tree_is_iterative_and_never_follows_links(tmp_path):
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep.txt").write_text("keep")
  root = tmp_path / "ws"
  root.mkdir()
  _deep_tree(str(root), 3 * sys.getrecursionlimit())
  os.symlink(str(outside), root / "link")
  os.mkdir(root / "locked")
  (root / "locked" / "f").write_text("x")
  os.chmod(root / "locked", 0)
  remove_tree(str(root))
  assert not root.exists()
  assert (outside / "keep.txt").read_text() == "keep"


def test_listing_is_bounded_on_deep_and_wide_trees(tmp_path):
  w = Workspace(str(tmp_path / "r"))
  try:
    w.write_initial({"a.py": "x = 1\n"})
    _deep_tree(w.path, 3 * sys.getrecursionlimit())
    for i in range(5000):
      os.close(os.open(os.path.join(w.path, f"w{i:05d}"), os.O_WRONLY | os.O_CREAT))
    entries, total = w.list_files(50, 10_000)
    assert len(entries) == 51 and entries[0] == "a.py (1 lines)"
    assert entries[-1].startswith("[listing stopped early")
  finally:
    w.close()
  assert not os.path.exists(w.path)


@pytest.mark.parametrize("raw,shown", [
    (b"calc.py", "calc.py"), (b"a b.py", "a b.py"), (b"x\ny", "'x\\ny'"),
    (b"\xff", "b'\\xff'"), (b"'q'", "\"'q'\""), (b"back\\slash", "'back\\\\slash'"),
    ("caf\u00e9".encode(), "caf\u00e9"), ("\u2028".encode(), "'\\u2028'"),
])
def test_render_name(raw, shown):
  assert render_name(raw) == shown
  assert "\n" not in render_name(raw)
