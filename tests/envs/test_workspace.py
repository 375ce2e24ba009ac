"""Workspace path confinement and host-side file access, checked against the real filesystem."""

import os

import pytest

from agentic_rl.envs.workspace import FileToolError, PathRefused, Workspace


@pytest.fixture
def ws(tmp_path):
  w = Workspace(str(tmp_path / "root"))
  w.write_initial({"a.py": "x = 1\n", "pkg/b.py": "y = 2\n"})
  yield w
  w.close()


@pytest.mark.parametrize("path,fragment", [
    ("/etc/passwd", "absolute paths"),
    ("../x", "'..'"),
    ("pkg/../../x", "'..'"),
    ("a b", "letters, digits"),
    ("~/.ssh/id_rsa", "letters, digits"),
    ("a\\b", "letters, digits"),
    (".", "the workspace itself"),
    ("", "empty path"),
])
def test_refuses_paths_outside(ws, path, fragment):
  with pytest.raises(PathRefused, match=fragment if fragment != "'..'" else "'\\.\\.'"):
    ws.resolve(path)


def test_symlinks_that_escape_are_refused_and_inner_ones_allowed(ws, tmp_path):
  secret = tmp_path / "secret.txt"
  secret.write_text("top secret")
  os.symlink(str(secret), os.path.join(ws.path, "leak"))
  os.symlink("/", os.path.join(ws.path, "rootdir"))
  os.symlink("..", os.path.join(ws.path, "up"))
  os.symlink("a.py", os.path.join(ws.path, "alias.py"))
  for p in ("leak", "rootdir/etc/passwd", "up/secret.txt", "up"):
    with pytest.raises(PathRefused, match="symlink leads outside"):
      ws.read_text(p, 1000)
  assert ws.read_text("alias.py", 1000) == "x = 1\n"
  with pytest.raises(PathRefused):
    ws.write_text("leak", "overwritten")
  assert secret.read_text() == "top secret"


def test_reads_regular_files_only_and_bounds_size(ws):
  os.mkfifo(os.path.join(ws.path, "pipe"))
  with pytest.raises(FileToolError, match="not a regular file"):
    ws.read_text("pipe", 100)  # Would block forever if opened for reading without O_NONBLOCK.
  with pytest.raises(FileToolError, match="is a directory"):
    ws.read_text("pkg", 100)
  with pytest.raises(FileToolError, match="no such file"):
    ws.read_text("missing.py", 100)
  with pytest.raises(FileToolError, match="over the 3-byte limit"):
    ws.read_text("a.py", 3)


def test_write_replaces_atomically_and_restore_removes_planted_links(ws, tmp_path):
  ws.write_text("a.py", "x = 2\n")
  assert open(os.path.join(ws.path, "a.py")).read() == "x = 2\n"
  with pytest.raises(FileToolError, match="no such file"):
    ws.write_text("new.py", "z")
  # A test file swapped for a link to the module must be restored without writing the module.
  os.unlink(os.path.join(ws.path, "pkg/b.py"))
  os.symlink("../a.py", os.path.join(ws.path, "pkg/b.py"))
  ws.restore_file("pkg/b.py", "y = 2\n")
  assert not os.path.islink(os.path.join(ws.path, "pkg/b.py"))
  assert open(os.path.join(ws.path, "pkg/b.py")).read() == "y = 2\n"
  assert open(os.path.join(ws.path, "a.py")).read() == "x = 2\n"
  os.unlink(os.path.join(ws.path, "pkg/b.py"))
  os.mkdir(os.path.join(ws.path, "pkg/b.py"))
  ws.restore_file("pkg/b.py", "y = 2\n")
  assert open(os.path.join(ws.path, "pkg/b.py")).read() == "y = 2\n"


def test_list_files_and_cleanup(ws):
  os.symlink("/etc", os.path.join(ws.path, "etc_link"))
  entries, total = ws.list_files(50, 10_000)
  assert entries == ["a.py (1 lines)", "etc_link (symlink)", "pkg/b.py (1 lines)"]
  assert total == 3
  path = ws.path
  ws.close()
  assert not os.path.exists(path)
  assert os.path.exists("/etc/passwd")  # The link was removed, not followed.


def test_orphaned_workspaces_of_dead_processes_are_removed(tmp_path):
  import subprocess
  import sys
  root = tmp_path / "wsroot"
  code = ("import os, sys; sys.path.insert(0, %r)\n"
          "from agentic_rl.envs.workspace import Workspace\n"
          "w = Workspace(%r); print(os.path.dirname(w.path), flush=True); os._exit(0)"
          % (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
             str(root)))
  parent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
  assert os.path.isdir(parent)  # os._exit skipped the atexit cleanup.
  w = Workspace(str(root))  # The next process to use the root removes it.
  assert not os.path.exists(parent) and os.path.isdir(w.path)
  w.close()
