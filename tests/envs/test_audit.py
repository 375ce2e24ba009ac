"""The hash-chained audit log: tamper detection line by line, sealing, threads, CLI."""

import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys

import pytest

from agentic_rl.envs.audit import GENESIS, AuditLog, verify_audit_log

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_log(path, n=5, run_id="run"):
  with AuditLog(str(path), run_id=run_id) as log:
    for i in range(n):
      log.record(trajectory_id=f"t{i % 2}", turn=i, tool=["ls", "test", "view"][i % 3],
                 args={"path": "x" * 300} if i == 1 else {}, decision="allowed",
                 output_sha256="0" * 64)
  return path


def read_lines(path):
  with open(path) as f:
    return f.read().splitlines(keepends=True)


def test_chain_matches_an_independent_recomputation(tmp_path):
  path = write_log(tmp_path / "a.jsonl")
  prev = GENESIS
  for i, line in enumerate(read_lines(path)):
    entry = json.loads(line)
    claimed = entry.pop("hash")
    assert entry["seq"] == i and entry["prev"] == prev
    body = json.dumps(entry, sort_keys=True, separators=(",", ":"))
    assert hashlib.sha256((prev + body).encode()).hexdigest() == claimed
    prev = claimed
  r = verify_audit_log(str(path))
  assert r.ok and r.sealed is True and r.lines == 5 and r.trajectories == 2
  assert r.by_tool == {"ls": 2, "test": 2, "view": 1} and r.by_decision == {"allowed": 5}
  # Arguments are truncated in the log, saying by how much.
  assert json.loads(read_lines(path)[1])["args"]["path"].endswith("...[+100 chars]")


@pytest.mark.parametrize("tamper,bad_line,fragment", [
    ("delete_middle", 3, "seq is 3, expected 2"),
    ("edit", 2, "hash does not match"),
    ("edit_and_rehash", 3, "prev does not match"),
    ("swap", 2, "seq is 2, expected 1"),
    ("garbage", 4, "not a JSON line"),
    ("delete_last", 5, "lost or appended"),
    ("append", 6, "lost or appended"),
])
def test_tampering_is_detected_at_the_first_bad_line(tmp_path, tamper, bad_line, fragment):
  path = write_log(tmp_path / "a.jsonl")
  lines = read_lines(path)
  if tamper == "delete_middle":
    del lines[2]
  elif tamper == "edit":
    lines[1] = lines[1].replace('"decision":"allowed"', '"decision":"denied"')
  elif tamper == "edit_and_rehash":  # A forger who recomputes the edited line's own hash.
    e = json.loads(lines[1])
    e.pop("hash")
    e["decision"] = "denied"
    body = json.dumps(e, sort_keys=True, separators=(",", ":"))
    e["hash"] = hashlib.sha256((e["prev"] + body).encode()).hexdigest()
    lines[1] = json.dumps(e, sort_keys=True, separators=(",", ":")) + "\n"
  elif tamper == "swap":
    lines[1], lines[2] = lines[2], lines[1]
  elif tamper == "garbage":
    lines[3] = "not json\n"
  elif tamper == "delete_last":
    del lines[-1]
  elif tamper == "append":
    lines.append(lines[-1])
  with open(path, "w") as f:
    f.writelines(lines)
  r = verify_audit_log(str(path))
  if tamper == "append":  # A duplicated line breaks the chain itself.
    assert not r.ok and r.bad_line == 6 and "seq is 4, expected 5" in r.message
    return
  assert not r.ok
  assert r.bad_line == bad_line, r.message
  assert fragment in r.message
  assert f"line {bad_line}" in r.message or "lost" in r.message


def test_unsealed_truncation_is_reported_as_unsealed(tmp_path):
  path = write_log(tmp_path / "a.jsonl")
  os.unlink(str(path) + ".seal")
  lines = read_lines(path)
  with open(path, "w") as f:
    f.writelines(lines[:-1])
  r = verify_audit_log(str(path))
  assert r.ok and r.sealed is None and r.lines == 4


def test_reopening_continues_the_chain(tmp_path):
  path = write_log(tmp_path / "a.jsonl", n=3, run_id="first")
  with AuditLog(str(path), run_id="second") as log:
    assert not os.path.exists(str(path) + ".seal")  # Live again until closed.
    log.record(trajectory_id="z", turn=1, tool="ls", args={}, decision="denied")
  r = verify_audit_log(str(path))
  assert r.ok and r.lines == 4 and r.sealed
  assert [json.loads(l)["run_id"] for l in read_lines(path)] == ["first"] * 3 + ["second"]


def test_refuses_to_append_to_a_broken_log(tmp_path):
  path = write_log(tmp_path / "a.jsonl")
  lines = read_lines(path)
  with open(path, "w") as f:
    f.writelines(lines[:1] + lines[2:])
  with pytest.raises(ValueError, match="cannot append"):
    AuditLog(str(path))


def test_concurrent_writers_keep_one_valid_chain(tmp_path):
  path = tmp_path / "c.jsonl"
  log = AuditLog(str(path))
  def work(k):
    for i in range(50):
      log.record(trajectory_id=f"t{k}", turn=i, tool="test", args={}, decision="allowed")
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(work, range(8)))
  log.close()
  r = verify_audit_log(str(path))
  assert r.ok and r.lines == 400 and r.trajectories == 8


def test_bad_decision_is_rejected():
  with pytest.raises(ValueError, match="decision"):
    AuditLog(None).record(trajectory_id="t", turn=1, tool="ls", args={}, decision="maybe")


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "launch.audit", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=60)


def test_cli_verify_summary_and_failure(tmp_path):
  path = write_log(tmp_path / "a.jsonl")
  ok = run_cli("verify", str(path))
  assert ok.returncode == 0, ok.stderr
  assert "chain of 5 lines verified" in ok.stdout
  assert "calls by tool:     ls=2, test=2, view=1" in ok.stdout
  assert "calls by decision: allowed=5" in ok.stdout
  js = json.loads(run_cli("verify", str(path), "--json").stdout)
  assert js["ok"] and js["lines"] == 5 and js["by_decision"] == {"allowed": 5}
  lines = read_lines(path)
  with open(path, "w") as f:
    f.writelines(lines[:2] + lines[3:])
  bad = run_cli("verify", str(path))
  assert bad.returncode == 1
  assert "line 3" in bad.stderr and "BROKEN" in bad.stdout
  os.unlink(str(path) + ".seal")
  write_log(tmp_path / "b.jsonl")
  os.unlink(str(tmp_path / "b.jsonl") + ".seal")
  assert run_cli("verify", str(tmp_path / "b.jsonl"), "--require_seal").returncode == 1
  assert run_cli("verify", str(tmp_path / "missing.jsonl")).returncode == 1
