"""Qwen3-30B-A3B's shape (eval_shape only: never initialised here), with a TPU v5p mesh.

48 layers, d_model 2048, 32 query / 4 kv heads of 128, 128 routed experts of width 768,
top-8 with renormalised gates, no shared experts, q/k norms, RoPE theta 1e6, vocab 151936,
untied head (Qwen/Qwen3-30B-A3B's config.json). The learner keeps float32 master params
and AdamW moments and computes in bfloat16.

Mesh: a TPU v5p-32 slice (16 chips, 95 GiB HBM each), fsdp 4 x expert 4. Per chip, for a
learner micro-batch of 16 sequences of 8192 tokens and 64 rollout slots of 8192, with each
layer rematerialised (remat='full'): params 7.1 GiB, gradients 7.1, AdamW 14.2,
activations 12.0, KV cache 3.0; 43.5 GiB in all. Without remat, 101.7 GiB: it does not
fit. v5p-16 (8 chips, fsdp 2 x expert 4) fits at 87.0 GiB, too tight for XLA's own
temporaries; 4 chips need 173.9 GiB.

    python -m launch.memory_plan --config configs/qwen3_30b_a3b.py
    python -m launch.memory_plan --config configs/qwen3_30b_a3b.py --config.model.remat=none
    python -m launch.memory_plan --config configs/qwen3_30b_a3b.py --mesh data=1,fsdp=2,expert=4

A real run imports the checkpoint (launch.import_hf) and uses the config.py it writes,
with this file's mesh.
"""

import ml_collections

from agentic_rl.model.config import default_model_config
from agentic_rl.parallel.mesh_config import default_mesh_config
from agentic_rl.rl.config import default_rl_config


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  m = default_model_config()
  m.vocab_size = 151_936
  m.d_model = 2048
  m.num_layers = 48
  m.layer_pattern = "F"
  m.num_heads = 32
  m.num_kv_heads = 4
  m.head_dim = 128
  m.rope_theta = 1_000_000.0
  m.norm_eps = 1e-6
  m.tie_embeddings = False
  m.qk_norm = True
  m.max_seq_len = 40_960
  m.num_dense_layers = 0
  m.d_ff = 6144
  m.moe.num_experts = 128
  m.moe.num_experts_per_token = 8
  m.moe.d_ff_expert = 768
  m.moe.num_shared_experts = 0
  m.moe.renormalize = True
  m.moe.aux_loss_coef = 1e-3
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.cache_dtype = "bfloat16"
  # Each layer recomputed in the backward. A pod run also sets moe.dispatch='all_to_all'
  # (experts over the expert axis, under the mesh) and kernel_backend='pallas' (flash-style
  # attention, no [T, S] scores: what the memory plan assumes); both stay at their
  # defaults here so the shapes trace on a CPU without a mesh.
  m.remat = "full"
  config.model = m
  mesh = config.mesh = default_mesh_config()
  mesh.data, mesh.fsdp, mesh.tensor, mesh.expert = 1, 4, 1, 4
  config.rl = default_rl_config()
  config.rl.loss.kl_coef = 0.0
  config.hbm_gib = 95.0  # TPU v5p.
  config.workload = ml_collections.ConfigDict({"batch": 16, "seq_len": 8192, "slots": 64,
                                               "rollout_len": 8192})
  return config
