"""Runs `python -m launch.train` (or another launch module) on the train-loop test configs."""

import json
import os
import subprocess
import sys

TINY_CONFIG = os.path.join(os.path.dirname(__file__), "tiny_config_file.py")


def env() -> dict:
  return dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")


def run_module(module: str, *args, timeout: int = 900) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], env=env(),
                        capture_output=True, text=True, timeout=timeout)


def train(workdir, *overrides, config: str = TINY_CONFIG) -> tuple[dict, str]:
  """Runs one training job to completion; returns (summary.json, stdout)."""
  out = run_module("launch.train", f"--config={config}", f"--workdir={workdir}", *overrides)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f), out.stdout


def metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]
