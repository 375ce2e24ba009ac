"""The countdown env (agentic_rl/envs/countdown.py) from scratch: SFT on its expert, then RL.

The second env behind `config.env.name`: the same trainer, engine and learner as the SWE
job, with the countdown env's own tasks, tiers, families and expert. Byte tokenizer, a
small S/G hybrid; a few minutes on 2 CPU cores.

    python -m launch.train --config configs/countdown.py --workdir /tmp/countdown
"""

import ml_collections

from agentic_rl.envs import countdown
from agentic_rl.model.config import default_model_config
from agentic_rl.parallel.mesh_config import default_mesh_config
from agentic_rl.rl.config import default_rl_config
from agentic_rl.rollout.config import default_rollout_config
from agentic_rl.rollout.tokenizer_config import default_tokenizer_config
from agentic_rl.train.config import default_train_config


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  m = config.model = default_model_config()
  m.vocab_size = 320  # The byte tokenizer's ids.
  m.d_model = 64
  m.num_layers = 2
  m.layer_pattern = "SG"
  m.max_seq_len = 512
  m.sliding_window = 64
  m.topk_tokens = 32

  config.tokenizer = default_tokenizer_config()  # Bytes: any text tokenizes.
  config.env = countdown.default_config()
  config.env.default_tier = "short"

  r = config.rollout = default_rollout_config()
  r.num_slots = 8
  r.max_len = 512
  r.prefill_chunk = 64
  r.group_size = 4
  r.max_turns = 12  # Enough for the long tier's 9 answers.
  r.max_new_tokens_per_turn = 32

  rl = config.rl = default_rl_config()
  rl.num_steps = 20
  rl.optim.learning_rate = 1e-3
  rl.optim.warmup_steps = 2
  rl.optim.decay_steps = 0  # The cosine spans the RL phase.
  rl.task_selection.pool_size = 32

  # Every device on the data axis; e.g. --config.mesh.fsdp=2 shards params and moments.
  config.mesh = default_mesh_config()

  t = config.train = default_train_config()
  t.sft_steps = 200
  t.sft_demos = 64
  t.sft_batch_size = 8
  t.sft_optim.learning_rate = 3e-3
  t.sft_optim.warmup_steps = 10
  t.groups_per_step = 4
  t.eval_every = 10
  t.eval_tasks = 16
  t.eval_temperature = 1.0
  t.eval_samples = 2
  t.checkpoint_every = 50
  return config
