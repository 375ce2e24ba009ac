"""No leaks: a call sees its own /proc (a fresh pid namespace and a private /proc
mount), a workspace path that does not name the host's, and none of the host's
environment. Checked from inside, through the same calls the agent makes."""

import json
import os

from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config, skip_unless_required

TASK = generate_task(11, "medium")
CANARY = "AGENTIC_RL_HOST_CANARY"

LOOK = """\
import json, os
procs = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        entry = {}
        for what in ("cmdline", "environ", "cwd", "root"):
            try:
                if what in ("cwd", "root"):
                    entry[what] = os.readlink(f"/proc/{p}/{what}")
                else:
                    entry[what] = open(f"/proc/{p}/{what}", "rb").read().decode("latin-1")
            except OSError as e:
                entry[what] = "denied " + type(e).__name__
        procs[p] = entry
seen = {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
        "ls": sorted(os.listdir(".")),
        "env": dict(os.environ), "procs": procs,
        "mountinfo": open("/proc/self/mountinfo").read()}
print("SEEN" + json.dumps(seen))
"""


def _seen(obs: str) -> dict:
  line = next(l for l in obs.split("\n") if l.startswith("SEEN"))
  return json.loads(line[4:])


def test_a_call_sees_only_itself(isolation, monkeypatch):
  monkeypatch.setenv(CANARY, "host secret")
  with SweEnv(env_config(isolation, max_observation_chars=200_000,
                         sandbox__capture_bytes=400_000)) as env:
    env.reset(TASK)
    sb = env._sandbox
    if not sb.per_call_namespaces_or_probe():
      skip_unless_required("this kernel refuses nested namespaces: no per-call pid namespace "
                           "(listed in the sandbox's warning)")
    host_ws = sb.workspace.path
    r = env.step(F("python", code=LOOK))
  seen = _seen(r.observation)
  # A fresh pid namespace: the call's own init and itself, nothing of the host or server.
  assert sorted(int(p) for p in seen["procs"]) == [1, seen["pid"]] and seen["ppid"] == 1
  blob = json.dumps(seen)
  for secret in ("sandbox_server", "def serve", CANARY, "host secret"):
    assert secret not in blob, secret
  if isolation == "fallback":
    return  # Its mount namespace is the host's copy: paths show (listed in its warning).
  for secret in ("agentic_rl_ws_", host_ws, f"_{os.getpid()}_"):
    assert secret not in blob, secret
  # No host environment variable reaches it.
  assert set(seen["env"]) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONHASHSEED", "PWD"}
  if isolation == "bubblewrap":
    assert seen["cwd"] == "/workspace"


# The same look, judged inside the graded process: what it saw (the host's mount table
# may be long) never travels, only a verdict of bounded size.
VERDICT = """\
_secrets = [bytes.fromhex(x).decode() for x in %r]
_found = {}
for _i, _s in enumerate(_secrets):
    _at = _blob.find(_s)
    if _at >= 0:
        _found[_i] = _blob[max(0, _at - 30):_at + len(_s) + 30]
_pids = sorted(int(p) for p in seen["procs"])
VERDICT = json.dumps({"pid": seen["pid"], "pids": _pids[:16], "npids": len(_pids),
                      "cwd": seen["cwd"][:200], "ls": [x[:100] for x in seen["ls"][:16]],
                      "nls": len(seen["ls"]), "found": _found, "blob_chars": len(_blob)})
"""


def test_a_graded_call_sees_only_itself(isolation, monkeypatch):
  # The same look from inside the module under repair, during a graded run.
  monkeypatch.setenv(CANARY, "host secret")
  with SweEnv(env_config(isolation)) as env:
    env.reset(TASK)
    sb = env._sandbox
    if not sb.per_call_namespaces_or_probe():
      skip_unless_required("no per-call namespaces on this kernel")
    host_ws = sb.workspace.path
    secrets = ["sandbox_server", CANARY, "host secret", "agentic_rl_ws_", host_ws]
    module = (LOOK.replace('print("SEEN" + json.dumps(seen))', "_blob = json.dumps(seen)")
              + VERDICT % [x.encode().hex() for x in secrets]
              + TASK.files[TASK.module_path]
              + f"\ndef {TASK.functions[0]}(*a):\n    return VERDICT\n")
    env.step(F("python", code=f"open({TASK.module_path!r}, 'w').write({module!r})"))
    replies = []
    request = sb.request
    def keep_reply(payload, *a, **k):
      r = request(payload, *a, **k)
      replies.append(r.reply)
      return r
    monkeypatch.setattr(sb, "request", keep_reply)
    r = env.step(F("test"))
  assert replies and replies[-1] is not None, r.observation
  outcomes = json.loads(replies[-1])["outcomes"]
  verdicts = [o["value"][1] for o in outcomes if o.get("value") and o["value"][0] == "S"]
  assert verdicts, outcomes
  seen = json.loads(verdicts[0])
  assert seen["pids"] == [1, seen["pid"]] and seen["npids"] == 2, seen
  found = {secrets[int(i)]: around for i, around in seen["found"].items()}
  for secret in ("sandbox_server", CANARY, "host secret"):
    assert secret not in found, (secret, found[secret])
  if isolation == "bubblewrap":
    for secret in ("agentic_rl_ws_", host_ws):
      assert secret not in found, (secret, found[secret])
  assert seen["cwd"] == sb.workdir
  # The graded process's directory holds the module under repair and nothing else: no
  # test file with its expected values, nothing the agent planted.
  assert seen["ls"] == [TASK.module_path] and seen["nls"] == 1, seen


def test_the_fallback_says_which_guarantees_it_cannot_give(caplog):
  import dataclasses
  import pathlib
  from agentic_rl.envs.sandbox import _Isolation, missing_guarantees, resolve_isolation
  weakest = _Isolation("fallback", "/usr/bin/python3", "/usr", False, False, "", nested=False)
  missing = missing_guarantees(weakest)
  assert len(missing) == 9
  assert missing_guarantees(dataclasses.replace(
      weakest, level="bubblewrap", network_isolated=True, drops_uid=True, nested=True,
      memory_cgroup=True)) == []
  # WORKSPACE.md lists each of them.
  doc = (pathlib.Path(__file__).parents[2] / "WORKSPACE.md").read_text()
  for line in missing:
    assert line.split(":")[0] in doc, line
  # The probe's warning names them.
  with caplog.at_level("WARNING", logger="agentic_rl.envs.sandbox"):
    resolve_isolation(env_config("fallback", sandbox__per_call_namespaces="off",
                                 sandbox__uid_count=4095))
  text = caplog.text
  assert "sandbox fallback cannot give" in text and "no mount namespace" in text
  assert "no per-call pid namespace" in text
