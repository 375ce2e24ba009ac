"""The embedded default: a tiny hybrid sparse-attention MoE that runs on a laptop CPU.

    python -m launch.model_info --config configs/quickstart.py
    python -m launch.check_consistency --config configs/quickstart.py
    # any field can be overridden: --config.model.layer_pattern=FFFF
"""

from agentic_rl.model.config import default_model_config
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  m = default_model_config()
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
  config.model = m
  return config
