"""The quickstart config shrunk so a whole SFT + RL run takes about a minute on 2 cores."""

from configs import quickstart


def tiny_config(seed: int = 0, base=None):
  """`base` (default: quickstart) shrunk; the route configs build on quickstart too."""
  config = quickstart.get_config() if base is None else base
  config.seed = seed
  r = config.rollout
  r.num_slots = 4
  r.max_len = 2048
  r.group_size = 2
  r.max_turns = 3
  r.max_new_tokens_per_turn = 12
  r.env_threads = 4
  config.rl.task_selection.max_sampling_rounds = 1
  config.rl.num_steps = 3
  t = config.train
  t.sft_steps = 2
  t.init_checkpoint = ""  # The tests start from fresh params, not the shipped base.
  t.sft_demos = 2
  t.sft_batch_size = 2
  t.groups_per_step = 2
  t.eval_every = 2
  t.eval_tasks = 2
  t.checkpoint_every = 1
  t.log_samples_every = 1
  t.num_samples_logged = 1
  return config
