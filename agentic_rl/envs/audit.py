"""A hash-chained, append-only JSONL audit log: one line per tool call.

Each line is a JSON object with the fields of `AuditLog.record` plus
`seq` (0, 1, 2, ... over the whole file), `prev` (the previous line's hash,
GENESIS for the first) and `hash` = sha256(prev + canonical JSON of the line
without `hash`). Editing, deleting, inserting or reordering a line breaks the
chain at that line. Deleting lines at the end leaves a valid shorter chain, so
`close()` also writes PATH + ".seal" (line count and last hash, replaced
atomically); `verify_audit_log` checks the tail against it.

Lines are written under a lock and flushed one by one (fsync per line on
request), so many env threads can share one log. Opening an existing log
continues its chain.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import threading
import time
import uuid

GENESIS = "0" * 64
DECISIONS = ("allowed", "denied", "timeout", "error")
SEAL_SUFFIX = ".seal"


def _canonical(obj: dict) -> str:
  return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def line_hash(entry_without_hash: dict) -> str:
  return hashlib.sha256((entry_without_hash["prev"] + _canonical(entry_without_hash))
                        .encode("ascii")).hexdigest()


def truncate_args(args: dict, max_chars: int) -> dict:
  out = {}
  for k, v in args.items():
    if isinstance(v, str) and len(v) > max_chars:
      v = v[:max_chars] + f"...[+{len(v) - max_chars} chars]"
    out[k] = v
  return out


class AuditLog:
  """Thread-safe; `path=None` keeps the chained entries in memory (`entries`)."""

  def __init__(self, path: str | None = None, run_id: str | None = None, fsync: bool = False,
               max_arg_chars: int = 200):
    self.path = path
    self.run_id = run_id or uuid.uuid4().hex[:12]
    self._fsync = fsync
    self._max_arg_chars = max_arg_chars
    self._lock = threading.Lock()
    self.entries: list[dict] = []
    self._prev, self._seq = GENESIS, 0
    self._file = None
    if path is not None:
      if os.path.exists(path) and os.path.getsize(path) > 0:
        result = verify_audit_log(path, check_seal=False)
        if not result.ok:
          raise ValueError(f"cannot append to {path}: {result.message}")
        self._prev, self._seq = result.last_hash, result.lines
      if os.path.exists(path + SEAL_SUFFIX):  # The log is live again; close() reseals it.
        os.unlink(path + SEAL_SUFFIX)
      self._file = open(path, "a", encoding="ascii")

  def record(self, *, trajectory_id: str, turn: int, tool: str | None, args: dict,
             decision: str, reason: str = "", exit_code: int | None = None,
             duration_s: float = 0.0, output_bytes: int = 0, output_sha256: str = "",
             extra: dict | None = None) -> dict:
    if decision not in DECISIONS:
      raise ValueError(f"audit decision must be one of {DECISIONS}, got {decision!r}")
    with self._lock:
      entry = {
          "seq": self._seq, "time": round(time.time(), 6), "run_id": self.run_id,
          "trajectory_id": trajectory_id, "turn": turn, "tool": tool,
          "args": truncate_args(args, self._max_arg_chars), "decision": decision,
          "reason": reason[:300], "exit_code": exit_code, "duration_s": round(duration_s, 6),
          "output_bytes": output_bytes, "output_sha256": output_sha256,
          **(extra or {}), "prev": self._prev}
      entry["hash"] = line_hash(entry)
      if self._file is not None:
        self._file.write(_canonical(entry) + "\n")
        self._file.flush()
        if self._fsync:
          os.fsync(self._file.fileno())
      else:
        self.entries.append(entry)
      self._prev, self._seq = entry["hash"], self._seq + 1
      return entry

  @property
  def lines(self) -> int:
    return self._seq

  def close(self) -> None:
    with self._lock:
      if self._file is None:
        return
      self._file.close()
      self._file = None
      seal = {"lines": self._seq, "last_hash": self._prev, "run_id": self.run_id}
      tmp = self.path + SEAL_SUFFIX + ".tmp"
      with open(tmp, "w", encoding="ascii") as f:
        f.write(_canonical(seal) + "\n")
      os.replace(tmp, self.path + SEAL_SUFFIX)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


@dataclasses.dataclass
class VerifyResult:
  ok: bool
  message: str
  lines: int = 0
  last_hash: str = GENESIS
  bad_line: int | None = None  # 1-based line number of the first bad line.
  sealed: bool | None = None  # None: no seal file; True: tail matches the seal.
  by_tool: dict = dataclasses.field(default_factory=dict)
  by_decision: dict = dataclasses.field(default_factory=dict)
  trajectories: int = 0


def verify_audit_log(path: str, check_seal: bool = True) -> VerifyResult:
  """Walks the chain; the message names the first bad line and what is wrong with it."""
  by_tool, by_decision = collections.Counter(), collections.Counter()
  trajectories = set()
  prev, n = GENESIS, 0

  def bad(lineno: int, why: str) -> VerifyResult:
    return VerifyResult(False, f"{path}: line {lineno}: {why}", n, prev, lineno,
                        by_tool=dict(by_tool), by_decision=dict(by_decision),
                        trajectories=len(trajectories))

  try:
    f = open(path, "rb")
  except OSError as e:
    return VerifyResult(False, f"{path}: cannot open: {e.strerror}", bad_line=None)
  with f:
    for lineno, raw in enumerate(f, start=1):
      try:
        entry = json.loads(raw.decode("ascii"))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return bad(lineno, f"not a JSON line ({e})")
      if not isinstance(entry, dict) or "hash" not in entry or "prev" not in entry:
        return bad(lineno, "missing 'hash'/'prev' fields")
      if entry.get("seq") != n:
        return bad(lineno, f"seq is {entry.get('seq')!r}, expected {n} (a line is missing or "
                           "out of order)")
      if entry["prev"] != prev:
        return bad(lineno, "prev does not match the hash of the line before (a line was "
                           "deleted, inserted or reordered)")
      claimed = entry.pop("hash")
      if line_hash(entry) != claimed:
        return bad(lineno, "hash does not match the line's content (the line was edited)")
      prev, n = claimed, n + 1
      by_tool[str(entry.get("tool"))] += 1
      by_decision[str(entry.get("decision"))] += 1
      trajectories.add(entry.get("trajectory_id"))
  sealed = None
  seal_path = path + SEAL_SUFFIX
  if check_seal and os.path.exists(seal_path):
    try:
      with open(seal_path, encoding="ascii") as sf:
        seal = json.loads(sf.read())
      if seal["lines"] != n or seal["last_hash"] != prev:
        return VerifyResult(
            False, f"{path}: the seal records {seal['lines']} lines ending in "
            f"{seal['last_hash'][:12]}, the log has {n} ending in {prev[:12]} (lines after "
            f"line {min(n, seal['lines'])} were lost or appended after closing)", n, prev,
            bad_line=min(n, seal["lines"]) + 1, sealed=False, by_tool=dict(by_tool),
            by_decision=dict(by_decision), trajectories=len(trajectories))
      sealed = True
    except (OSError, ValueError, KeyError, TypeError) as e:
      return VerifyResult(False, f"{seal_path}: unreadable seal ({e})", n, prev, sealed=False)
  return VerifyResult(True, f"{path}: chain of {n} lines verified", n, prev, None, sealed,
                      dict(by_tool), dict(by_decision), len(trajectories))
