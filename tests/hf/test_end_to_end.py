"""End to end: a tiny random Qwen3-MoE with Qwen3's tokenizer and chat template, imported by
launch.import_hf, trains 2 RL steps on the SWE env through its template and native JSON tool
calls; sampler and learner agree to KL < 1e-6 in float32 with routing replay. The trained run
exports to a folder transformers loads, and launch.evaluate scores the import itself."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.hf import model_fixture, tokenizer_fixture  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=900):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


@pytest.mark.slow  # ~1.5 min alone: import, 2 RL steps, export, parity, evaluate.
def test_two_rl_steps_from_an_imported_qwen3_moe(tmp_path):
  hf_dir = str(tmp_path / "hf")
  tokenizer_fixture.write_tiny_qwen3_tokenizer(hf_dir, vocab_size=512)
  model_fixture.build("qwen3_moe", vocab_size=512).save_pretrained(hf_dir)
  imported = str(tmp_path / "imported")
  _run("launch.import_hf", "--hf_dir", hf_dir, "--workdir", imported)
  with open(os.path.join(imported, "config.json")) as f:
    saved = json.load(f)
  tokenizer = saved["tokenizer"]
  assert (tokenizer["kind"], tokenizer["path"], tokenizer["chat_template"]) == (
      "hf", imported, "file")
  workdir = str(tmp_path / "run")
  _run("launch.train", f"--config={imported}/config.py", f"--workdir={workdir}",
       "--config.rl.num_steps=2", "--config.train.groups_per_step=2",
       "--config.rollout.group_size=2", "--config.rollout.num_slots=4",
       "--config.rollout.max_turns=2", "--config.rollout.max_new_tokens_per_turn=24",
       "--config.train.eval_every=2", "--config.train.eval_tasks=2",
       "--config.train.checkpoint_every=1", "--config.rl.task_selection.max_sampling_rounds=1",
       "--config.rl.ppo_epochs=1", "--config.rl.minibatches=1")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    steps = [json.loads(line) for line in f if "mismatch/k3" in line]
  assert len(steps) == 2
  for m in steps:
    assert abs(m["mismatch/k3"]) < 1e-6 and abs(m["mismatch/k1"]) < 1e-6, m
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["config"]["env"]["tool_format"] == "json"
  assert summary["config"]["model"]["qk_norm"] and summary["config"]["model"]["moe"][
      "num_shared_experts"] == 0
  # The trained run exports to a folder transformers loads and agrees with.
  exported = str(tmp_path / "exported")
  _run("launch.export_hf", f"--checkpoint={workdir}", f"--config={imported}/config.py",
       f"--out={exported}")
  assert {"tokenizer.json", "tokenizer_config.json", "config.json",
          "model.safetensors"} <= set(os.listdir(exported))
  parity = json.loads(_run("launch.hf_parity", "--hf_dir", exported, "--json").strip()
                      .splitlines()[-1])
  assert parity["max_abs_logit_diff"] < 1e-4 and parity["decode_max_abs_logit_diff"] < 1e-4
  # launch.evaluate takes the imported folder itself as a checkpoint.
  scored = _run("launch.evaluate", f"--config={imported}/config.py", f"--checkpoint={imported}",
                f"--workdir={tmp_path / 'eval'}", "--config.train.eval_tasks=2",
                "--config.rollout.max_turns=1", "--config.rollout.max_new_tokens_per_turn=8")
  result = json.loads(scored.strip().splitlines()[-1])
  assert result["checkpoint"]["file"] == os.path.join(imported, "params.safetensors")
  assert "heldout/solve_rate" in result
