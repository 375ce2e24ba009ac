"""This project's sampler against google-tunix's Sampler and transformers' `generate`, on
one workload, interleaved in one run (this machine drifts ~15% over minutes).

    python -m launch.compare_samplers --tunix_python VENV_T/bin/python \
        --hf_python VENV_H/bin/python --cases dense:32,dense:64,moe:64 --rounds 3 --json

Each peer runs in its own venv (launch/peers/*.py import nothing of this project);
--baseline_pythonpath adds this project's engine from another checkout (e.g. the commit
before a change). Per round, every case runs every implementation once, each in a fresh
process (one untimed call that compiles, then --repeats timed calls, median). A case is
dense:B or moe:B (8 experts, top-2, expert MLP 256, every layer routed, no shared expert);
the shape is launch.bench_sampler's default. Prints per case and implementation the median
tokens/s over rounds and ours over the better peer.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import app
from absl import flags

_TUNIX = flags.DEFINE_string("tunix_python", "", "Python of a venv with google-tunix.")
_HF = flags.DEFINE_string("hf_python", "", "Python of a venv with transformers and torch.")
_BASELINE = flags.DEFINE_string("baseline_pythonpath", "",
                                "A checkout whose engine runs as 'baseline'.")
_CASES = flags.DEFINE_list("cases", ["dense:32", "dense:64", "moe:64"], "kind:batch cases.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per process.")
_PROMPT = flags.DEFINE_integer("prompt", 128, "Prompt tokens.")
_GEN = flags.DEFINE_integer("gen", 128, "Generated tokens.")
_JSON = flags.DEFINE_bool("json", False, "Print only the JSON report.")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MOE = ["--num_experts=8", "--experts_per_tok=2", "--d_ff_expert=256"]


def _commands(kind: str, batch: int) -> dict[str, tuple[list[str], dict]]:
  shape = [f"--batch={batch}", f"--prompt={_PROMPT.value}", f"--gen={_GEN.value}",
           f"--repeats={_REPEATS.value}"] + (MOE if kind == "moe" else [])
  ours = [sys.executable, "-m", "launch.bench_sampler", "--json"] + shape
  env = dict(os.environ, PYTHONPATH=ROOT)
  out = {"ours": (ours, env)}
  if _BASELINE.value:  # This bench script, the other checkout's package.
    out["baseline"] = ([sys.executable, os.path.join(HERE, "bench_sampler.py"), "--json"]
                       + shape, dict(os.environ, PYTHONPATH=_BASELINE.value))
  clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  if _TUNIX.value:
    out["tunix"] = ([_TUNIX.value, os.path.join(HERE, "peers", "tunix_sampler.py")] + shape,
                    clean)
  if _HF.value:
    out["hf_generate"] = ([_HF.value, os.path.join(HERE, "peers", "hf_generate.py")] + shape,
                          clean)
  return out


def main(argv):
  del argv
  runs: dict[str, dict[str, list[dict]]] = {}
  for r in range(_ROUNDS.value):
    for case in _CASES.value:
      kind, batch = case.split(":")
      if kind not in ("dense", "moe"):
        raise app.UsageError(f"--cases: {case!r} is not dense:B or moe:B")
      for impl, (command, env) in _commands(kind, int(batch)).items():
        out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=1800)
        if out.returncode != 0:
          raise RuntimeError(f"{impl} {case} failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        runs.setdefault(case, {}).setdefault(impl, []).append(result)
        if not _JSON.value:
          print(f"round {r} {case} {impl}: {result['tokens_per_s']:.0f} tok/s", flush=True)
  report = {}
  for case, impls in runs.items():
    medians = {impl: statistics.median(x["tokens_per_s"] for x in results)
               for impl, results in impls.items()}
    peers = [medians[p] for p in ("tunix", "hf_generate") if p in medians]
    report[case] = {"tokens_per_s": medians,
                    "runs": {impl: [round(x["tokens_per_s"], 1) for x in results]
                             for impl, results in impls.items()},
                    "ours_over_best_peer": medians["ours"] / max(peers) if peers else None}
  print(json.dumps({"cases": report, "rounds": _ROUNDS.value, "prompt": _PROMPT.value,
                    "gen": _GEN.value}))


if __name__ == "__main__":
  app.run(main)
