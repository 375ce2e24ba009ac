"""Checks a tool-call audit log: `python -m launch.audit verify PATH [--json] [--require_seal]`.

Walks the hash chain of PATH (agentic_rl/envs/audit.py), and the seal file
PATH.seal when present, then prints a summary: lines, trajectories, calls by
tool and by decision. Exits 1 naming the first bad line when the chain is
broken, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys

from agentic_rl.envs.audit import SEAL_SUFFIX, verify_audit_log


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m launch.audit",
                                   description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  v = sub.add_parser("verify", help="verify the hash chain of an audit log and summarize it")
  v.add_argument("path")
  v.add_argument("--json", action="store_true", help="print the summary as one JSON object")
  v.add_argument("--require_seal", action="store_true",
                 help=f"fail when {SEAL_SUFFIX} is missing (a truncated tail is then undetectable)")
  args = parser.parse_args(argv)

  r = verify_audit_log(args.path)
  ok = r.ok and not (args.require_seal and r.sealed is None)
  summary = {"ok": ok, "path": args.path, "lines": r.lines, "trajectories": r.trajectories,
             "sealed": r.sealed, "by_tool": r.by_tool, "by_decision": r.by_decision,
             "first_bad_line": r.bad_line, "message": r.message}
  if args.json:
    print(json.dumps(summary, sort_keys=True))
  else:
    print(("OK: " if r.ok else "BROKEN: ") + r.message)
    print(f"lines: {r.lines}  trajectories: {r.trajectories}  sealed: "
          + {None: "no seal file (a lost tail cannot be detected)", True: "yes, tail matches",
             False: "MISMATCH"}[r.sealed])
    print("calls by tool:     " + ", ".join(f"{k}={n}" for k, n in sorted(r.by_tool.items())))
    print("calls by decision: " + ", ".join(f"{k}={n}" for k, n in sorted(r.by_decision.items())))
  if not r.ok:
    print(f"error: {r.message}", file=sys.stderr)
    return 1
  if not ok:
    print(f"error: {args.path}{SEAL_SUFFIX} is missing and --require_seal was given",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
