"""Re-scores a shipped base's params under the current env and grading; updates base.json.

    python -m launch.rescore_base --base configs/assets/base_tiny_bpe --workdir /tmp/rescore \
        --reason "graded on hidden cases (issue 28)"

Scores under --config's eval settings (configs/sft_base.py's by default, those the base
was exported with), writes the new held-out scores into BASE/base.json and appends the
scores they replace, with the reason, this command and the params file's sha256, to its
"rescored" list. The params are only read. Refuses a --config whose eval settings are not
the base's. --workdir holds the sandboxes' audit log.
"""

import json
import os

from absl import app
from absl import flags
from absl import logging

from agentic_rl import resources
from agentic_rl.train import params_file
from launch import compilation_cache
from launch import config_flag

_CONFIG = config_flag.define_config("configs/sft_base.py", "Config file.")
_BASE = flags.DEFINE_string("base", None, "The base folder (params.safetensors, base.json).",
                            required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the audit log goes.", required=True)
_REASON = flags.DEFINE_string("reason", None, "Why the scores changed (recorded).",
                              required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  compilation_cache.enable()  # Reruns, resumes and seeds load programs from disk.
  from agentic_rl.train.evaluation import base_json_scores  # After flag parsing: --help
  from agentic_rl.train.trainer import Trainer  # stays fast.
  base_dir = resources.resolve(_BASE.value)  # `configs/assets/...` names the shipped base.
  path = os.path.join(base_dir, "base.json")
  with open(path) as f:
    base = json.load(f)
  settings = {"tasks": int(_CONFIG.value.train.eval_tasks),
              "samples_per_task": int(_CONFIG.value.train.eval_samples),
              "temperature": float(_CONFIG.value.train.eval_temperature)}
  if settings != base["eval_settings"]:
    raise app.UsageError(f"--config's eval settings {settings} are not the base's "
                         f"{base['eval_settings']}: scores would not compare.")
  trainer = Trainer(_CONFIG.value, _WORKDIR.value)
  try:
    result = trainer.evaluate_checkpoint(base_dir, source="--base")
  finally:
    trainer.close()
  digest = params_file.file_sha256(os.path.join(base_dir, params_file.PARAMS_FILE))
  scores = base_json_scores(result)
  previous = {k: base[k] for k in scores if k in base}
  base.setdefault("rescored", []).append({
      "reason": _REASON.value, "previous": previous, "params_file_sha256": digest,
      "command": f"python -m launch.rescore_base --base {_BASE.value} --workdir DIR "
                 f"--reason {_REASON.value!r}"})
  base.update(scores)
  with open(path, "w") as f:
    json.dump(base, f, indent=1)
  print(json.dumps({"previous": previous, "now": scores}, indent=1))


if __name__ == "__main__":
  app.run(main)
