"""The embedded default: a tiny hybrid sparse-attention MoE agent on the SWE environment.

CPU-sized. SFT on the scripted expert's episodes, then GRPO on easy-tier tasks.

    python -m launch.train --config configs/quickstart.py --workdir /tmp/quickstart
    python -m launch.train --config configs/quickstart.py --config.rl.num_steps=50 --workdir DIR
    python -m launch.model_info --config configs/quickstart.py
    python -m launch.check_consistency --config configs/quickstart.py
"""

import ml_collections

from agentic_rl.envs.config import default_env_config
from agentic_rl.model.config import default_model_config
from agentic_rl.rl.config import default_rl_config
from agentic_rl.rollout.config import default_rollout_config
from agentic_rl.rollout.tokenizer import default_tokenizer_config
from agentic_rl.train.config import default_train_config, route_a_overrides


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  m = config.model = default_model_config()
  m.vocab_size = 320  # byte tokenizer: 256 bytes + specials
  m.d_model = 64
  m.num_layers = 4
  m.layer_pattern = "SSSG"
  m.num_heads = 4
  m.num_kv_heads = 2
  m.head_dim = 16
  m.max_seq_len = 4096
  m.sliding_window = 64
  m.block_size = 8
  m.topk_tokens = 64
  m.num_dense_layers = 1
  m.d_ff = 128
  m.moe.num_experts = 8
  m.moe.num_experts_per_token = 2
  m.moe.d_ff_expert = 32
  m.moe.num_shared_experts = 1

  config.tokenizer = default_tokenizer_config()
  config.env = default_env_config()

  r = config.rollout = default_rollout_config()
  r.num_slots = 8
  r.max_len = 2048
  r.prefill_chunk = 256
  r.group_size = 4
  r.max_turns = 8
  r.max_new_tokens_per_turn = 48
  r.temperature = 1.0

  rl = config.rl = default_rl_config()
  rl.num_steps = 10
  rl.optim.learning_rate = 1e-3
  rl.optim.warmup_steps = 2
  rl.optim.decay_steps = 200
  rl.task_selection.group_size = r.group_size
  rl.task_selection.heldout_fraction = 0.0  # The env's held-out split is separate seeds.

  t = config.train = default_train_config()
  t.sft_steps = 12
  t.sft_demos = 32
  t.sft_batch_size = 4
  t.groups_per_step = 2
  t.eval_every = 5
  t.eval_tasks = 16
  config.route_a = route_a_overrides()
  return config
