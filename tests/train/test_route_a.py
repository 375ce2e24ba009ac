"""One route A: the config file and the stage switch apply the same definition, for any
layer pattern, credit included; at the switch the state takes route A's layout (a fresh
critic, every shared param and optimiser moment carried over)."""

import jax
import numpy as np
import pytest

from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib
from agentic_rl.train import config as train_config_lib
from agentic_rl.train.routes import Routes, graft
from configs import quickstart, route_a_consistency
from tests.train.tiny_config import tiny_config


def test_the_config_file_is_the_switch_s_route_a():
  switched = train_config_lib.route_a_config(quickstart.get_config())
  file = route_a_consistency.get_config()
  for section in ("model", "rl", "rollout", "env", "tokenizer"):
    assert file[section].to_dict() == switched[section].to_dict(), section
  assert file.model.layer_pattern == "SSSF" and file.model.value_head
  assert file.rl.advantage.estimator == "gae" and file.rl.correction.type == "none"
  # It validates: GAE's critic is there.
  rl_config_lib.validate(file.rl, file.model, file.rollout)


@pytest.mark.parametrize("pattern,dense", [("SSSG", "SSSF"), ("SGSG", "SFSF"), ("G", "F"),
                                           ("SSF", "SSF")])
def test_route_a_makes_any_pattern_s_sparse_layers_dense(pattern, dense):
  config = quickstart.get_config()
  config.model.layer_pattern = pattern
  assert train_config_lib.route_a_config(config).model.layer_pattern == dense


def test_a_layer_pattern_named_in_config_route_a_wins():
  config = quickstart.get_config()
  config.route_a.model.layer_pattern = "SSSS"
  assert train_config_lib.route_a_config(config).model.layer_pattern == "SSSS"


def test_a_config_without_a_route_a_section_gets_the_default():
  config = quickstart.get_config()
  del config["route_a"]
  assert train_config_lib.route_a_config(config).model.value_head


def _routes(switch_at):
  config = tiny_config()
  config.train.switch_to_route_a_at = switch_at
  spec = train_config_lib.validate_train_config(config.train)
  tokenizer = tokenizer_lib.make_tokenizer(config.tokenizer)
  return config, Routes(config, spec, tokenizer, env_factory=lambda: None)


def test_the_switch_grafts_a_fresh_critic_and_keeps_every_shared_leaf():
  config, routes = _routes(switch_at=1)
  try:
    base = routes.for_step(0)
    state = base.init_state(seed=5)
    # Non-zero optimiser moments and count, as after some steps.
    state = state.replace(opt_state=jax.tree.map(
        lambda x: x + (0.25 if np.issubdtype(x.dtype, np.floating) else 3), state.opt_state))
    route_a = routes.for_step(1)
    assert route_a.name == "A" and base.name == "base"
    adopted = route_a.adopt(state, config.seed)
    assert "value_head" in adopted.params and "value_head" not in state.params
    flat_old = dict(jax.tree_util.tree_leaves_with_path(state.opt_state))
    carried = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(adopted.opt_state):
      if path in flat_old:
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat_old[path]))
        carried += 1
      else:  # Only the critic's moments are new, and they start at zero.
        assert "value_head" in jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(leaf), 0)
    assert carried == len(flat_old)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
      got = adopted.params
      for key in path:
        got = got[key.key]
      np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf))
    assert adopted.step is state.step
    # Already in route A's layout: returned as is.
    assert route_a.adopt(adopted, config.seed) is adopted
  finally:
    routes.close()


def test_graft_names_a_shared_leaf_whose_shape_differs():
  with pytest.raises(ValueError, match=r"\['w'\].*shape \(3,\).*expects \(2,\)"):
    graft({"w": np.zeros(2), "b": np.zeros(1)}, {"w": np.zeros(3)})
  out = graft({"w": np.zeros(2, np.float32), "new": np.ones(1)}, {"w": np.arange(2.0)})
  assert out["w"].dtype == np.float32 and list(out["w"]) == [0.0, 1.0]
  assert list(out["new"]) == [1.0]
