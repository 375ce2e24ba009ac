"""episodes.placeholder_trajectory: a batch of it is shaped as a batch of the engine's
trajectories, leaf for leaf, so a learner step compiled on it serves the real ones."""

import jax
import numpy as np

from agentic_rl.envs.countdown import CountdownEnv
from agentic_rl.records.trajectory import to_batch
from agentic_rl.rollout import episodes
from tests.rollout.conftest import make_engine


def test_a_placeholder_batch_matches_an_engine_batch_leaf_for_leaf(tiny_model, tokenizer,
                                                                   sampled_steps):
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, max_len=256)
  trajs = engine.run([{"start": 3, "pad": 2}, {"start": 4, "pad": 0}])
  engine.close()
  length = max(t.length for t in trajs) + 5
  real = to_batch(trajs, length=length)
  placeholder = episodes.placeholder_trajectory(tiny_model[0].spec,
                                                engine.spec.temperature, length)
  fake = to_batch([placeholder] * len(trajs))
  assert jax.tree.structure(fake) == jax.tree.structure(real)
  for a, b in zip(jax.tree.leaves(fake), jax.tree.leaves(real)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
  assert float(np.asarray(fake.loss_mask_bt).sum()) == 0.0  # Nothing to learn from.
