"""Route B, throughput first: hybrid 3:1 sparse attention, bf16 sampler cache, big groups, TIS.

The sampler's cache is bfloat16 while the learner recomputes in fp32, so the
two policies differ slightly; truncated importance sampling (weight min(r, 2))
corrects the gradient and the mismatch metrics measure what it corrects.
`--config.train.switch_to_route_a_at=N` moves to route A's settings at RL step
N (throughput early, consistency late).

    python -m launch.train --config configs/route_b_throughput.py --workdir /tmp/route_b
"""

from configs import quickstart


def get_config():
  config = quickstart.get_config()
  config.model.layer_pattern = "SSSG"
  config.model.cache_dtype = "bfloat16"
  config.rollout.group_size = 8
  config.rl.correction.type = "tis"
  config.rl.correction.tis_cap = 2.0
  config.rl.replay.blocks = False  # Sampler and learner select blocks independently...
  config.rl.replay.routing = True  # ...but MoE routing, which amplifies noise, is replayed.
  # The shipped base was trained with an fp32 cache; this run samples from bf16 (deliberate).
  config.train.allow_fingerprint_change = ("cache_dtype",)
  return config
