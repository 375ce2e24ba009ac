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


def test_the_decode_parts_bench_reports_each_part():
  out = subprocess.run([sys.executable, "-m", "launch.bench_decode_parts", "--json",
                        "--batch=4", "--positions=16", "--d_model=32", "--head_dim=8",
                        "--d_ff_expert=16", "--iters=1"],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["attention_ms"] > 0 and r["read_gb_per_s"] > 0
  assert set(r["moe_experts_ms"]) == {"ragged_dot", "grouped", "one_expert_every_row"}
  assert r["moe_rows"] == 8 and r["moe_group_bound"] == 8
  assert r["forward_ms"]["cached_decode"] > 0 and r["kv_len"] == 16 and r["capacity"] == 24
