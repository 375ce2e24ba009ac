"""Property: no edit of the module earns more reward than the share of cases that an
independent oracle says the edited module passes.

The oracle imports the edited module in a fresh interpreter of its own, in a directory
holding only that module, calls the functions on each case's arguments and prints the
reprs; this test process parses them back and compares them, type-exactly, with the
expected values. Edits are random: any subset of the bugs fixed, lines replaced or
deleted, and the reward hacks of test_grader_isolation placed at the top or bottom.
"""

import ast
import json
import secrets
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config
from tests.envs.test_grader_isolation import HACK_ROOM, HACKS, TASK

ORACLE = r"""
import ast, importlib, json, sys
spec = json.loads(sys.stdin.readline())
sys.path.insert(0, ".")
out = None
try:
    m = importlib.import_module(spec["module"])
    fns = {n: getattr(m, n) for n in spec["functions"]}
except BaseException:
    pass
else:
    out = []
    for name, args in spec["calls"]:
        try:
            out.append(["ok", repr(fns[name](*ast.literal_eval(args)))])
        except BaseException:
            out.append(["error"])
sys.stdout.write("\n" + spec["nonce"] + json.dumps(out) + "\n")
"""


def _same(a, b) -> bool:
  if type(a) is not type(b):
    return False
  if isinstance(a, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  return a == b


GRADED = TASK.hidden_cases  # The cases submit grades.


def oracle_share(module_text: str, tmp_dir) -> float:
  (tmp_dir / TASK.module_path).write_text(module_text)
  nonce = secrets.token_hex(8)
  spec = {"module": TASK.module_path[:-3], "functions": list(TASK.functions), "nonce": nonce,
          "calls": [[c.function, repr(c.args)] for c in GRADED]}
  try:
    p = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", ORACLE], cwd=tmp_dir,
                       input=json.dumps(spec) + "\n", capture_output=True, text=True,
                       timeout=10)
  except subprocess.TimeoutExpired:
    return 0.0
  lines = [l for l in p.stdout.split("\n") if l.startswith(nonce)]
  out = json.loads(lines[-1][len(nonce):]) if lines else None
  if out is None:
    return 0.0
  passed = 0
  for case, res in zip(GRADED, out):
    if res[0] == "ok":
      try:
        passed += _same(ast.literal_eval(res[1]), case.want)
      except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
  return passed / len(GRADED)


MODULE_LINES = TASK.files[TASK.module_path].rstrip("\n").split("\n")
BODY_LINES = [i for i, l in enumerate(MODULE_LINES) if l.startswith("    ")]


@st.composite
def edits(draw):
  lines = list(MODULE_LINES)
  for bug in TASK.bugs:  # Any subset of the bugs fixed.
    if draw(st.booleans()):
      lines[bug.line - 1] = bug.correct_line
  for _ in range(draw(st.integers(0, 2))):  # Bodies rewritten to constants.
    i = draw(st.sampled_from(BODY_LINES))
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + draw(st.sampled_from(
        ["return 0", "return []", "return None", "return True", "pass", "return x"]))
  if draw(st.booleans()):
    del lines[draw(st.integers(0, len(lines) - 1))]
  text = "\n".join(lines) + "\n"
  for hack in draw(st.lists(st.sampled_from(sorted(HACKS)), max_size=2, unique=True)):
    code, where = HACKS[hack]
    text = code + text if where == "top" else text + code
  return text


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(module=edits())
def test_no_edit_earns_more_than_the_oracle_says(module, tmp_path_factory):
  tmp = tmp_path_factory.mktemp("oracle")
  with SweEnv(env_config(timeout_s=5.0, reward="tests_fraction", **HACK_ROOM)) as env:
    env.reset(TASK)
    r = env.step(F("python", code=f"open({TASK.module_path!r}, 'w').write({module!r})"))
    assert r.info["exit_code"] == 0, r.observation  # The edit is in place.
    r = env.step(F("submit"))
  share = oracle_share(module, tmp)
  assert r.reward <= share + 1e-9, (r.reward, share, r.observation)
  hacked = any(HACKS[h][0] in module for h in HACKS)
  if not hacked:  # Honest edits are graded exactly as the oracle grades them.
    assert r.reward == share, (r.reward, share, r.observation)


def test_the_oracle_is_not_fooled_by_the_hacks(tmp_path):
  # The oracle itself scores a hacked, unfixed module as the unfixed module.
  unfixed = TASK.hidden_initial_passed / TASK.num_hidden
  assert oracle_share(TASK.files[TASK.module_path], tmp_path) == unfixed
  for hack, (code, where) in sorted(HACKS.items()):
    base = TASK.files[TASK.module_path]
    assert oracle_share(code + base if where == "top" else base + code, tmp_path) == unfixed
