"""launch.bench_sampler runs the engine end to end and reports what it measured."""

import json
import subprocess
import sys

import pytest


def _bench(*flags) -> dict:
  out = subprocess.run([sys.executable, "-m", "launch.bench_sampler", "--json", "--batch=4",
                        "--prompt=16", "--gen=6", "--num_layers=2", "--d_model=32",
                        "--d_ff=64", "--head_dim=8", "--vocab_size=64", "--repeats=1", "--prefill_chunk=16",
                        *flags], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags", [(), ("--num_experts=4", "--d_ff_expert=16", "--top_k=5")])
def test_every_prompt_generates_its_budget_and_the_report_adds_up(flags):
  r = _bench(*flags)
  assert (r["batch"], r["prompt"], r["gen"]) == (4, 16, 6)
  assert r["tokens_per_s"] == pytest.approx(4 * 6 / r["seconds"])
  assert r["compile_seconds"] > 0 and r["ms_per_decode_step"] > 0
  # One draw comes with the fork from the prompt store; the rest decode, plus one flush.
  assert r["decode_steps_per_run"] >= 6 - 1
  assert r["moe"] == bool(flags) and r["params"] > 0
