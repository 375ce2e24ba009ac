"""The reference architecture at full scale: narrow-deep, very sparse MoE, 1M-token context.

64 layers of "SSSG" (3 gated sliding-window layers per sparse full-attention
layer), block top-k sparse GQA with B=8 and k=4096 (512 blocks per query group).
Layers scanned (scan_layers): the two dense-FFN layers' group unrolled, then one SSSG
group scanned 15 times, so the program does not grow with depth.
Never initialised on the CPU: tests and model_info build it with jax.eval_shape.

    python -m launch.model_info --config configs/full_scale.py --json
"""

from agentic_rl.model.config import default_model_config
import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  m = default_model_config()
  m.vocab_size = 151_936
  m.d_model = 2048
  m.num_layers = 64
  m.layer_pattern = "SSSG"
  m.num_heads = 16
  m.num_kv_heads = 4
  m.head_dim = 128
  m.tie_embeddings = False
  m.max_seq_len = 1 << 20
  m.sliding_window = 4096
  m.block_size = 8
  m.topk_tokens = 4096
  m.num_dense_layers = 2
  m.d_ff = 8192
  m.moe.num_experts = 256
  m.moe.num_experts_per_token = 8
  m.moe.d_ff_expert = 512
  m.moe.num_shared_experts = 1
  m.moe.gate = "sigmoid"
  m.moe.aux_loss_coef = 1e-4
  m.moe.use_routing_bias = True
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.cache_dtype = "bfloat16"
  m.scan_layers = True
  config.model = m
  return config
