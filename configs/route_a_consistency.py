"""Route A, consistency first: strict attention, dropless replayed MoE, fp32, critic credit.

The sampler and learner compute the same function: G layers become dense F
(same parameters), caches stay fp32, routing, block selection and sampling
masks are replayed, and credit comes from a value head (GAE). No importance
correction is needed; the mismatch metrics should read ~0 (< 1e-6).

    python -m launch.train --config configs/route_a_consistency.py --workdir /tmp/route_a
"""

from configs import quickstart


def get_config():
  config = quickstart.get_config()
  m = config.model
  m.layer_pattern = "SSSF"
  m.dtype = m.param_dtype = m.cache_dtype = "float32"
  m.value_head = True
  rl = config.rl
  rl.advantage.estimator = "gae"
  rl.correction.type = "none"
  rl.replay.routing = rl.replay.blocks = rl.replay.sampling_mask = True
  # The shipped base was trained with G layers; F layers reuse their parameters (deliberate).
  config.train.allow_fingerprint_change = ("layer_pattern",)
  return config
