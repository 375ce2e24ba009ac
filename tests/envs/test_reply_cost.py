"""A reply built to burn host CPU: a dict of int keys that all hash alike.

Before, the host decoded a forged reply of ~26k such keys into a Python dict, which
took 3.9 s of host CPU (under the GIL) per graded call, against 0.025 s for an
ordinary 1 MiB reply. Now replies are capped at an honest reply's size, dicts at
MAX_DICT_ITEMS entries, and decoded dicts are indexed by salted str keys, never by the
keys' own hashes: such a reply costs under 0.1 s.
"""

import json
import sys
import time

import pytest

from agentic_rl.envs import grading
from agentic_rl.envs.sandbox_server import MAX_DICT_ITEMS, decode_plain
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config
from tests.envs.forged_reply import forging_lines

TASK = generate_task(4, "easy")
_MODULUS = sys.hash_info.modulus  # Every multiple of it hashes to 0.


def colliding_dict(n: int) -> list:
  return ["D", [[["I", str(k * _MODULUS)], ["N"]] for k in range(1, n + 1)]]


def colliding_reply(n: int, cases) -> str:
  """A reply whose first outcome is a dict of n colliding keys; the others are errors."""
  outcomes = ([{"status": "value", "value": colliding_dict(n)}]
              + [{"status": "error", "error": "E", "where": ""}] * (len(cases) - 1))
  return json.dumps({"import_error": None, "import_where": "", "output": "",
                     "outcomes": outcomes})


def largest_admitted_colliding_reply(cases, max_value_chars=4096) -> str:
  """Every outcome a colliding dict as large as the value cap admits."""
  n = 1
  while len(json.dumps(colliding_dict(n + 1))) <= max_value_chars:
    n += 1
  outcomes = [{"status": "value", "value": colliding_dict(n)}] * len(cases)
  return json.dumps({"import_error": None, "import_where": "", "output": "",
                     "outcomes": outcomes})


def test_the_keys_really_collide():
  # The payload is real: one hash for all, and a dict of them takes quadratic time.
  keys = [int(k[0][1]) for k in colliding_dict(4000)[1]]
  assert len({hash(k) for k in keys}) == 1
  t0 = time.process_time()
  dict.fromkeys(keys)
  colliding = time.process_time() - t0
  t0 = time.process_time()
  dict.fromkeys(range(1, 4001))
  assert colliding > 20 * (time.process_time() - t0)


def test_the_old_attack_is_refused_at_a_glance():
  reply = colliding_reply(24_000, TASK.hidden_cases)  # ~0.9 MB: fitted the old 1 MiB cap.
  t0 = time.process_time()
  with pytest.raises(grading.MalformedReply, match="honest"):
    grading.parse_reply(TASK, TASK.hidden_cases, reply)
  assert time.process_time() - t0 < 0.1


@pytest.mark.parametrize("tier", ["tiny", "hard"])
def test_the_worst_colliding_reply_the_caps_admit_costs_under_a_tenth_of_a_second(tier):
  task = generate_task(4, tier)
  reply = largest_admitted_colliding_reply(task.hidden_cases)
  t0 = time.process_time()
  report = grading.parse_reply(task, task.hidden_cases, reply)
  assert time.process_time() - t0 < 0.1
  # It decodes (each dict within the caps) and is simply not the expected value.
  assert report.passed == 0 and all(r.status == "fail" for r in report.results)


def test_a_colliding_dict_within_the_caps_decodes_in_linear_time():
  tagged = colliding_dict(MAX_DICT_ITEMS)
  t0 = time.process_time()
  for _ in range(20):
    d = decode_plain(tagged, 1 << 20, grading.PlainDict)
  assert (time.process_time() - t0) / 20 < 0.01
  assert len(d) == MAX_DICT_ITEMS


def test_a_module_that_forges_a_colliding_reply_costs_the_host_little(isolation):
  # colliding_reply(24_000, TASK.cases), built at import: as a literal it would make the
  # module too large to grade.
  head = ('{"import_error": null, "import_where": "", "output": "", '
          '"outcomes": [{"status": "value", "value": ["D", [')
  tail = ']]}' + ', {"status": "error", "error": "E", "where": ""}' * (len(TASK.cases) - 1) + ']}'
  item = '[["I", "%d"], ["N"]]'
  forged = forging_lines("(_head + _items + _tail).encode()", prelude=(
      "import sys as _sys",
      f"_head, _tail, _item = {head!r}, {tail!r}, {item!r}",
      "_items = ', '.join(_item % (k * _sys.hash_info.modulus) for k in range(1, 24001))"))
  with SweEnv(env_config(isolation, timeout_s=5.0, process_signal_on_edit=False)) as env:
    env.reset(TASK)
    env.step(F("test"))  # Starts the sandbox's server, outside the measurement.
    with open(env._sandbox.workspace.resolve(TASK.module_path), "w") as f:
      f.write("\n".join(forged) + "\n" + TASK.files[TASK.module_path])
    t0 = time.process_time()
    r = env.step(F("test"))
    host_cpu = time.process_time() - t0
  assert "0/" in r.observation and "passed" in r.observation, r.observation
  assert host_cpu < 0.1, host_cpu
