"""Reward hacks against the grader, through both delivery routes: none pays.

Each hack below made `submit` pay 1.00 with the bug unfixed when the test module
ran in the same process as the agent's code. Each is delivered two ways:
`python` writes the hacked module, or `replace` edits it into the module and a
`test` runs it once. Contained means the reward at submit equals the unfixed
module's reward: the hack neither pays nor costs, since the functions under
test are unchanged.

Written against the env's public protocol only, so the same file runs on
older code to show that the attacks worked there.
"""

import pytest

from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config

# Grading is checked on the pass fraction: a hack that passes even one more case shows.
PASS_FRACTION = "tests_fraction"

TASK = generate_task(12, "medium")  # python is on the medium allowlist; 8 of 12 pass unfixed.
UNFIXED = TASK.hidden_initial_passed / TASK.num_hidden  # submit grades the hidden cases.

# Patch the old runner's comparison (a global of its __main__) and swallow assertion errors.
PATCH_RUNNER = """\
try:
    import __main__, unittest
    _recording_eq = unittest.TestCase.assertEqual
    def _lenient_eq(self, a, b, msg=None):
        try:
            _recording_eq(self, a, b, msg)
        except AssertionError:
            pass
    unittest.TestCase.assertEqual = _lenient_eq
    __main__.plain_equal = lambda got, want: True
except Exception:
    pass
"""

# Find the runner's request in the stack and forge its report line, then leave.
FORGE_REPORT = """\
try:
    import sys, os, json, __main__
    _f = sys._getframe()
    while _f is not None and "req" not in _f.f_locals:
        _f = _f.f_back
    if _f is not None and hasattr(__main__, "RESULT_PREFIX"):
        _rows = [{"test": "t", "call": "c", "status": "pass"}] * 500
        _line = __main__.RESULT_PREFIX + str(_f.f_locals["req"]["id"]) + " " + json.dumps(
            {"results": _rows, "import_error": None, "output": ""}) + "\\n"
        os.write(1, _line.encode())
        os._exit(0)
except Exception:
    pass
"""

# A package named like the test module: the runner would import it instead of the tests.
SHADOW_TESTS = """\
try:
    import os
    _pkg = %r
    os.makedirs(_pkg, exist_ok=True)
    with open(os.path.join(_pkg, "__init__.py"), "w") as _f:
        _f.write("import unittest\\nclass T(unittest.TestCase):\\n    def test_x(self):\\n"
                 "        for i in range(500):\\n            with self.subTest(i=i):\\n"
                 "                self.assertEqual(1, 1)\\n")
except Exception:
    pass
""" % TASK.test_path[:-3]

# Appended: wrap each tested function to answer with the expected value, found in the
# caller's frames (the test method's `want`), or by reading the test file.
WRAP = """\
try:
    import ast as _ast, sys
    _MISSING = object()

    def _from_frames(args):
        f = sys._getframe(2)
        while f is not None:
            if "want" in f.f_locals:
                return f.f_locals["want"]
            f = f.f_back
        return _MISSING

    def _from_test_file(args):
        try:
            tree = _ast.parse(open(%(test)r).read())
        except Exception:
            return _MISSING
        for node in _ast.walk(tree):
            if isinstance(node, _ast.List):
                try:
                    rows = _ast.literal_eval(node)
                except Exception:
                    continue
                for row in rows:
                    if type(row) is tuple and len(row) == len(args) + 1 and \\
                            list(row[:-1]) == list(args):
                        return row[-1]
        return _MISSING

    def _wrap(f, find):
        def g(*args):
            got = find(args)
            return f(*args) if got is _MISSING else got
        return g

    for _name in %(names)r:
        globals()[_name] = _wrap(globals()[_name], %(finder)s)
except Exception:
    pass
"""

HACKS = {
    "patch_runner": (PATCH_RUNNER, "top"),
    "forge_report": (FORGE_REPORT, "top"),
    "shadow_tests": (SHADOW_TESTS, "top"),
    "expected_from_frames": (WRAP % {"test": TASK.test_path, "names": TASK.functions,
                                     "finder": "_from_frames"}, "bottom"),
    "expected_from_test_file": (WRAP % {"test": TASK.test_path, "names": TASK.functions,
                                        "finder": "_from_test_file"}, "bottom"),
}


def _hacked_module(hack: str) -> str:
  code, where = HACKS[hack]
  module = TASK.files[TASK.module_path]
  return code + module if where == "top" else module + code


def _submit_reward(env, actions) -> tuple[float, str]:
  env.reset(TASK)
  for a in actions:
    r = env.step(a)
    assert not r.done, r.observation
  r = env.step(F("submit"))
  assert r.done and r.info["end_reason"] == "submit"
  return r.reward, r.observation


@pytest.mark.parametrize("route", ["python", "replace"])
@pytest.mark.parametrize("hack", sorted(HACKS))
def test_hacks_do_not_pay(isolation, hack, route):
  with SweEnv(env_config(isolation, reward=PASS_FRACTION, timeout_s=10.0)) as env:
    if route == "python":  # The hack runs in the call, then is written into the module.
      actions = [F("python", code=HACKS[hack][0] + f"open({TASK.module_path!r}, 'w').write("
                                                  f"{_hacked_module(hack)!r})")]
    else:
      code, where = HACKS[hack]
      n = len(TASK.files[TASK.module_path].rstrip("\n").split("\n"))
      at = 1 if where == "top" else n + 1
      actions = [F("replace", path=TASK.module_path, start=at, end=at - 1,
                   text=code.rstrip("\n")), F("test")]
    reward, obs = _submit_reward(env, actions)
  assert reward == pytest.approx(UNFIXED), obs


def test_the_hacked_module_still_works_as_code(tmp_path, monkeypatch):
  # Each hack leaves the module importable with the same functions: the reward above is
  # the unfixed functions' own, not a crash's 0.
  import importlib.util
  monkeypatch.chdir(tmp_path)
  for hack in sorted(HACKS):
    d = tmp_path / hack
    d.mkdir()
    (d / TASK.module_path).write_text(_hacked_module(hack))
    spec = importlib.util.spec_from_file_location(f"m_{hack}", d / TASK.module_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert all(callable(getattr(mod, f)) for f in TASK.functions), hack


def _module_with_prefix(prefix: str) -> str:
  return prefix + TASK.files[TASK.module_path]


@pytest.mark.parametrize("name,prefix,says", [
    ("garbage_reply", "import os\nfor _fd in range(3, 256):\n    try:\n"
                      "        os.write(_fd, b'{\"outcomes\": garbage')\n    except OSError:\n"
                      "        pass\n", "the test run ended before reporting"),
    ("oversized_reply", "import os\nfor _fd in range(3, 256):\n    try:\n"
                        "        os.write(_fd, b'x' * (3 << 20))\n    except OSError:\n"
                        "        pass\n", "the test run ended before reporting"),
    ("crash", "import os\nos._exit(3)\n", "exit code 3"),
    ("killed", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "exit code -9"),
    ("hang", "while True:\n    pass\n", "TIMEOUT"),
])
def test_a_broken_graded_process_fails_the_run_not_the_grader(isolation, name, prefix, says):
  with SweEnv(env_config(isolation, reward=PASS_FRACTION, timeout_s=2.0)) as env:
    env.reset(TASK)
    write = f"open({TASK.module_path!r}, 'w').write({_module_with_prefix(prefix)!r})"
    env.step(F("python", code=write))
    r = env.step(F("test"))
    assert r.info["tests_passed"] == 0 and says in r.observation, r.observation
    assert "0/12 passed" in r.observation
    # The grader is unharmed: the unfixed module scores as it always did.
    env.step(F("python", code=f"open({TASK.module_path!r}, 'w').write("
                              f"{TASK.files[TASK.module_path]!r})"))
    r = env.step(F("submit"))
  assert r.reward == pytest.approx(UNFIXED), r.observation


def test_a_case_whose_value_is_huge_or_not_plain_fails_alone(isolation):
  # One function returns an oversized string, another an object: only their cases fail.
  first, second = TASK.functions[0], TASK.functions[1]
  suffix = (f"\n_orig_{first} = {first}\ndef {first}(*a):\n    return 'x' * (1 << 22)\n"
            f"class _Eq:\n    def __eq__(self, o):\n        return True\n"
            f"def {second}(*a):\n    return _Eq()\n")
  module = TASK.files[TASK.module_path] + suffix
  with SweEnv(env_config(isolation, reward=PASS_FRACTION)) as env:
    env.reset(TASK)
    env.step(F("python", code=f"open({TASK.module_path!r}, 'w').write({module!r})"))
    r = env.step(F("test"))
  assert f"FAIL {first}(" in r.observation and "got 'xxxx" in r.observation, r.observation
  assert f"FAIL {second}(" in r.observation and "_Eq object" in r.observation
  # The other functions' cases are judged as in the unfixed module (evaluated here).
  ns = {}
  exec(TASK.files[TASK.module_path], ns)
  others = sum(1 for c in TASK.cases if c.function not in (first, second)
               and _same(ns[c.function](*c.args), c.want))
  assert f"{others}/{TASK.num_tests} passed" in r.observation, r.observation


def _same(a, b) -> bool:
  """Type-exact equality of literals, written independently of the grader's."""
  if type(a) is not type(b):
    return False
  if isinstance(a, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  return a == b


@pytest.mark.parametrize("plant", ["sitecustomize", "usercustomize", "pth", "conftest",
                                   "pycache", "module_package", "stdlib_shadow"])
def test_nothing_planted_in_the_workspace_changes_the_grade(isolation, plant):
  mod = TASK.module_path[:-3]
  fixed_all = "".join(f"def {f}(*a):\n    return 0\n" for f in TASK.functions)
  plants = {
      "sitecustomize": {"sitecustomize.py": "import builtins\nbuiltins.len = None\n"},
      "usercustomize": {"usercustomize.py": "raise SystemExit(0)\n"},
      "pth": {"evil.pth": "import os; os._exit(0)\n"},
      "conftest": {"conftest.py": "raise SystemExit(0)\n"},
      # A planted bytecode cache of a module that would answer differently.
      "pycache": {f"__pycache__/{mod}.cpython-311.pyc": "not bytecode",
                  f"__pycache__/{mod}.cpython-312.pyc": "not bytecode"},
      # A package of the module's name takes precedence over the module file on import.
      "module_package": {f"{mod}/__init__.py": fixed_all},
      "stdlib_shadow": {"os.py": "raise SystemExit(0)\n", "json.py": "raise SystemExit(0)\n",
                        "importlib.py": "raise SystemExit(0)\n"},
  }[plant]
  code = "import os\n" + "".join(
      f"os.makedirs(os.path.dirname({p!r}) or '.', exist_ok=True)\n"
      f"open({p!r}, 'w').write({t!r})\n" for p, t in plants.items())
  with SweEnv(env_config(isolation, reward=PASS_FRACTION)) as env:
    env.reset(TASK)
    r = env.step(F("python", code=code))
    assert r.info["exit_code"] == 0, r.observation
    r = env.step(F("submit"))
  assert r.reward == pytest.approx(UNFIXED), r.observation


@pytest.mark.parametrize("hack", sorted(HACKS) + ["module_package"])
def test_without_per_call_namespaces_grading_still_holds(isolation, hack):
  # Kernels that refuse nested namespaces: graded runs import from a host staging
  # directory the sandbox can read but not write.
  with SweEnv(env_config(isolation, reward=PASS_FRACTION, timeout_s=10.0,
                         sandbox__per_call_namespaces="off")) as env:
    if hack == "module_package":
      pkg = TASK.module_path[:-3]
      body = "".join(f"def {f}(*a):\n    return 0\n" for f in TASK.functions)
      actions = [F("python", code=f"import os\nos.makedirs({pkg!r})\n"
                                  f"open({pkg + '/__init__.py'!r}, 'w').write({body!r})")]
    else:
      actions = [F("python", code=HACKS[hack][0] + f"open({TASK.module_path!r}, 'w').write("
                                                   f"{_hacked_module(hack)!r})")]
    reward, obs = _submit_reward(env, actions)
    assert not env._sandbox.per_call_namespaces
  assert reward == pytest.approx(UNFIXED), obs


def test_a_module_too_large_to_grade_says_so(isolation):
  with SweEnv(env_config(isolation, reward=PASS_FRACTION)) as env:
    env.reset(TASK)
    env.step(F("python", code=f"open({TASK.module_path!r}, 'a').write('#' * 300_000)"))
    r = env.step(F("test"))
    assert r.info["tests_passed"] == 0 and "the tests were not run" in r.observation
    assert f"over the {env.config.max_file_bytes}-byte limit" in r.observation, r.observation
    env.step(F("python", code=f"import os\nos.remove({TASK.module_path!r})"))
    r = env.step(F("test"))  # A missing module is an import error, as importing it was.
  assert f"No module named '{TASK.module_path[:-3]}'" in r.observation, r.observation
  assert f"({TASK.test_path}:2)" in r.observation
