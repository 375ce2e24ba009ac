"""The shipped base model (configs/assets/base_tiny_bpe): complete, loadable, competent; and the
documented recipe rebuilds a (reduced) one that loads and scores."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from agentic_rl import resources
from agentic_rl.envs import config as env_config_lib
from agentic_rl.envs.datasets import SweTaskSource
from agentic_rl.envs.expert import play_expert
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.rollout import config as rollout_config_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib
from agentic_rl.train import params_file
from agentic_rl.train import sft as sft_lib
from configs import quickstart
from tests.train import run_train

BASE = resources.resolve(quickstart.BASE)


def test_the_shipped_base_is_complete():
  assert os.path.getsize(os.path.join(BASE, "params.safetensors")) <= 32 * 2 ** 20
  with open(os.path.join(BASE, "base.json")) as f:
    base = json.load(f)
  assert base["command"].startswith("python -m launch.train --config configs/sft_base.py")
  assert base["sft_steps"] > 0 and base["heldout_episodes"] >= 256
  assert 0 < base["heldout_solve_rate_sft"] <= base["heldout_pass_at_k_sft"] <= 1
  assert base["params_sha256"] == params_file.file_sha256(
      os.path.join(BASE, params_file.PARAMS_FILE))
  with open(os.path.join(BASE, "config.json")) as f:
    assert json.load(f)["model"]["d_model"] == quickstart.get_config().model.d_model


def test_the_shipped_base_loads_and_imitates_the_expert_on_unseen_tasks():
  config = quickstart.get_config()
  spec = model_config_lib.validate(config.model)
  model = transformer.Model(spec)
  params = params_file.load_params(BASE, model.init(jax.random.key(0)), "configs/assets/base_tiny_bpe")
  env_config = env_config_lib.validate_env_config(config.env,
                                                  max_turns=config.rollout.max_turns)
  tokenizer = tokenizer_lib.make_tokenizer(config.tokenizer)
  rollout_spec = rollout_config_lib.validate(config.rollout, spec)
  tasks = [SweTaskSource("heldout", config=env_config)[i] for i in range(500, 508)]
  demos = sft_lib.render_demonstrations(tokenizer, rollout_spec, lambda: SweEnv(env_config),
                                        tasks, play_expert=play_expert)
  arrays = {k: jnp.asarray(v) for k, v in sft_lib.demonstration_arrays(
      [d for d in demos if d], 512).items()}
  nll, accuracy = sft_lib.demonstration_scores(model, params, arrays)
  # A fresh init scores ~1/1024; the base predicts the expert's next token almost always.
  assert float(accuracy) > 0.9 and float(nll) < 0.5, (float(nll), float(accuracy))


@pytest.mark.slow
def test_the_recipe_rebuilds_a_reduced_base_that_loads_and_scores(tmp_path):
  sft_dir, out = str(tmp_path / "sft"), str(tmp_path / "base")
  reduced = ["--config.train.sft_steps=40", "--config.train.sft_demos=16",
             "--config.train.sft_eval_every=10", "--config.train.sft_validation_demos=4",
             "--config.train.sft_patience=2", "--config.train.eval_tasks=4",
             "--config.train.checkpoint_every=20"]
  summary, stdout = run_train.train(sft_dir, *reduced, config="configs/sft_base.py")
  assert 0 < summary["sft_steps"] <= 40 and "validation nll" in stdout
  done = run_train.run_module("launch.export_base", "--config=configs/sft_base.py",
                              f"--workdir={sft_dir}", f"--out={out}", *reduced)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  with open(os.path.join(out, "base.json")) as f:
    base = json.load(f)
  assert base["sft_steps"] == summary["sft_steps"]
  assert base["heldout_solve_rate_sft"] == summary["heldout_solve_rate_sft"]
  assert base["heldout_episodes"] == 8
  # Re-scored under the same grading, the same params score the same.
  done = run_train.run_module("launch.rescore_base", "--config=configs/sft_base.py",
                              f"--base={out}", f"--workdir={tmp_path / 'rescore'}",
                              "--reason=unchanged", *reduced)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  with open(os.path.join(out, "base.json")) as f:
    rescored = json.load(f)
  assert rescored["rescored"][-1]["reason"] == "unchanged"
  assert rescored["rescored"][-1]["previous"]["heldout_solve_rate_sft"] == \
      base["heldout_solve_rate_sft"] == rescored["heldout_solve_rate_sft"]
  # The quickstart starts from it and scores it under its own settings.
  rl, _ = run_train.train(str(tmp_path / "rl"), f"--config.train.init_checkpoint={out}",
                          "--config.rl.num_steps=0", "--config.train.eval_tasks=4",
                          config="configs/quickstart.py")
  assert rl["init_checkpoint"]["file"] == os.path.join(out, "params.safetensors")
  assert rl["heldout_episodes"] == 8 and rl["heldout_solve_rate_sft"] is not None
  assert rl["params_sha256"] == summary["params_sha256"]
