"""Routes end to end: A's sampler and learner agree (KL < 1e-6); B's bf16 sampler cache
leaves a measurable mismatch; a B run switched to A at a step is consistent from there on."""

import numpy as np

from tests.train import run_train


def _train(workdir, route, *overrides):
  summary, _ = run_train.train(workdir, "--config.rl.num_steps=2", *overrides,
                               config=f"{run_train.TINY_CONFIG}:{route}")
  return summary, [r for r in run_train.metrics(workdir) if "mismatch/k3" in r]


def test_route_a_reports_mismatch_kl_under_1e6(tmp_path):
  summary, rl = _train(str(tmp_path), "route_a")
  assert summary["config"]["model"]["layer_pattern"] == "SSSF"
  assert summary["config"]["rl"]["advantage"]["estimator"] == "gae"
  assert len(rl) == 2 and summary["mismatch_kl_mean"] < 1e-6
  assert all(r["mismatch/routing_agreement"] == 1.0 for r in rl)
  # rollout/* counts every sampled episode, batch/* the groups the learner kept (2 x 2).
  assert all(r["batch/episodes"] == 4 and r["rollout/episodes"] >= 4 for r in rl)


def test_route_b_mismatch_then_switch_to_route_a(tmp_path):
  switch = "--config.train.switch_to_route_a_at=1"
  # Step 0 on route B, then stop: the checkpoint at rl_step 1 holds B's layout (no critic).
  _train(str(tmp_path), "route_b", switch, "--config.rl.num_steps=1")
  # Resumed at the switch: B's state restores, then step 1 adopts route A's layout.
  summary, rl = _train(str(tmp_path), "route_b", switch)
  assert [r["stage/route_a"] for r in rl] == [0.0, 1.0]
  b_kl, a_kl = rl[0]["mismatch/k3"], rl[1]["mismatch/k3"]
  # bf16 sampler cache vs the fp32 learner: a mismatch the metrics can see (TIS corrects it);
  # after the switch the fp32, dense, fully replayed route agrees to round-off.
  assert b_kl > 1e-6, b_kl
  assert a_kl < 1e-6 and a_kl < b_kl / 10, (a_kl, b_kl)
  # Route A's credit comes with it: a critic trains from the switch on (GAE).
  assert "value_loss" not in rl[0] and np.isfinite(rl[1]["value_loss"])
  # The base route's (the quickstart's turn-level credit), not route A's GAE.
  assert summary["config"]["rl"]["advantage"]["estimator"] == "turn_level"

  # Resumed after the switch: route A's layout, critic included, restores and goes on.
  resumed, rl = _train(str(tmp_path), "route_b", switch, "--config.rl.num_steps=3")
  assert resumed["rl_steps"] == 3 and len(rl) == 3
  assert rl[2]["stage/route_a"] == 1.0 and np.isfinite(rl[2]["value_loss"])
