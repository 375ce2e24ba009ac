"""Writes a finished SFT run as a shipped base model: params, config, recipe and scores.

    python -m launch.train --config configs/sft_base.py --workdir /tmp/sft_base
    python -m launch.export_base --workdir /tmp/sft_base --out configs/assets/base_tiny_bpe

The folder gets params.safetensors (the run's final params: with a plateau stop, its best
validation step), config.json (the run's config), and base.json: the command that built
it, its SFT steps, and its held-out pass@1 (with standard error) and pass@k curve, scored
here under the config's evaluation settings (the same episodes the run's own score drew).
base.json's params_sha256 is the sha256 of the params.safetensors written beside it.
`config.train.init_checkpoint=FOLDER` starts a run from it.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app
from absl import flags
from absl import logging

from agentic_rl.train import params_file
from launch import compilation_cache
from launch import config_flag

_CONFIG = config_flag.define_config("configs/sft_base.py",
                                          "The config the run was built with.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The finished SFT run.", required=True)
_OUT = flags.DEFINE_string("out", None, "The folder to write.", required=True)
_COMMAND = flags.DEFINE_string(
    "command", "python -m launch.train --config configs/sft_base.py --workdir DIR",
    "The command that built the run (recorded in base.json).")
_MAX_MB = flags.DEFINE_float("max_mb", 32.0, "Refuse to write a params file above this.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  compilation_cache.enable()  # Reruns, resumes and seeds load programs from disk.
  summary_path = os.path.join(_WORKDIR.value, "summary.json")
  if not os.path.exists(summary_path):
    raise app.UsageError(f"{summary_path} does not exist: is the run finished?")
  with open(summary_path) as f:
    summary = json.load(f)
  from agentic_rl.train.evaluation import base_json_scores  # After flag parsing: --help
  from agentic_rl.train.trainer import Trainer  # stays fast.
  with tempfile.TemporaryDirectory() as scratch:
    trainer = Trainer(_CONFIG.value, scratch)
    try:
      params, provenance = trainer.load_params(_WORKDIR.value, "--workdir")
      # Scored here, under the config's eval settings: the numbers belong to these params.
      scored = trainer.score_params(params)
    finally:
      trainer.close()
  config = summary["config"]
  scores = base_json_scores(scored)
  meta = {"description": f"SFT base, {summary['sft_steps']} SFT steps "
                         f"(best validation step {provenance['sft_best_step']})",
          "phase": "sft", "sft_step": summary["sft_steps"], "rl_step": 0}
  os.makedirs(_OUT.value, exist_ok=True)
  file = params_file.save_params(_OUT.value, params, meta)
  size_mb = os.path.getsize(file) / 2 ** 20
  if size_mb > _MAX_MB.value:
    os.remove(file)
    raise app.UsageError(f"params are {size_mb:.1f} MiB, over --max_mb={_MAX_MB.value}.")
  with open(os.path.join(_OUT.value, "config.json"), "w") as f:
    json.dump(config, f, indent=1)
  base = {"command": _COMMAND.value,
          "export_command": f"python -m launch.export_base --workdir DIR --out {_OUT.value}",
          "sft_steps": summary["sft_steps"], "sft_best_step": provenance["sft_best_step"],
          "sft_plateau": provenance["sft_plateau"], "wall_seconds": summary["wall_seconds"],
          "eval_settings": {"tasks": config["train"]["eval_tasks"],
                            "samples_per_task": config["train"]["eval_samples"],
                            "temperature": config["train"]["eval_temperature"]},
          **scores, "params_mb": round(size_mb, 3),
          # The file written above, not the run summary's digest of its in-memory params.
          "params_sha256": params_file.file_sha256(file)}
  with open(os.path.join(_OUT.value, "base.json"), "w") as f:
    json.dump(base, f, indent=1)
  print(json.dumps(base, indent=1))


if __name__ == "__main__":
  app.run(main)
