"""Route A, consistency first: strict attention, dropless replayed MoE, fp32, critic credit.

The sampler and learner compute the same function: G layers become dense F
(same parameters), caches stay fp32, routing, block selection and sampling
masks are replayed, and credit comes from a value head (GAE). No importance
correction is needed; the mismatch metrics should read ~0 (< 1e-6).

    python -m launch.train --config configs/route_a_consistency.py --workdir /tmp/route_a
"""

from agentic_rl.train.config import route_a_config
from configs import quickstart


def get_config():
  # The same route A the stage switch applies (train/config.py route_a_overrides).
  config = route_a_config(quickstart.get_config())
  # The shipped base was trained with G layers; F layers reuse their parameters (deliberate).
  config.train.allow_fingerprint_change = ("layer_pattern",)
  return config
