"""The second env through the main job: launch.train runs SFT and RL on the countdown env."""

import pytest

from tests.train import run_train


@pytest.mark.slow
def test_launch_train_runs_the_countdown_env(tmp_path):
  summary, out = run_train.train(
      str(tmp_path), "--config.train.sft_steps=1", "--config.rl.num_steps=1",
      "--config.train.sft_demos=4", "--config.train.sft_batch_size=4",
      "--config.train.eval_tasks=2", "--config.train.groups_per_step=2",
      "--config.rollout.num_slots=4", config="configs/countdown.py")
  assert summary["config"]["env"]["name"] == "countdown"
  assert summary["rl_steps"] == 1 and summary["heldout_episodes"] == 4
  metrics = run_train.metrics(str(tmp_path))
  sft = [m for m in metrics if "sft/loss" in m]
  rl = [m for m in metrics if "rollout/reward_mean" in m]
  assert len(sft) == 1 and len(rl) == 1
  # Every sampled episode is a countdown episode: a reward in [0, 1], turns within budget.
  assert 0.0 <= rl[0]["rollout/reward_mean"] <= 1.0
  group = summary["config"]["rollout"]["group_size"]
  # Dynamic sampling may draw more groups than it keeps: whole groups, at least two.
  assert rl[0]["rollout/episodes"] >= 2 * group and rl[0]["rollout/episodes"] % group == 0
  assert "SFT: 4 expert demonstrations" in out
