"""The model says which replay records each layer has; consumers never test layer letters."""

from agentic_rl.model import config as config_lib


def test_replay_keys_follow_the_layer_plan():
  c = config_lib.default_model_config()
  c.num_layers, c.layer_pattern, c.num_dense_layers = 4, "SGFG", 1
  spec = config_lib.validate(c)
  assert [spec.replay_keys(i) for i in range(4)] == [
      (), ("experts", "blocks"), ("experts",), ("experts", "blocks")]
  c.moe.num_experts = 0
  assert [config_lib.validate(c).replay_keys(i) for i in range(4)] == [
      (), ("blocks",), (), ("blocks",)]
