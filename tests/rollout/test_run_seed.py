"""config.seed drives the sampler: one seed repeats exactly, another samples other tokens."""

from agentic_rl.envs.countdown import CountdownEnv
from agentic_rl.rollout import engine as engine_lib
from tests.rollout.conftest import rollout_spec


def _sample(tiny_model, tokenizer, steps, seed):
  model, params = tiny_model
  engine = engine_lib.RolloutEngine(model, params, rollout_spec(model, seed=seed, group_size=2),
                                    tokenizer, CountdownEnv, steps=steps)
  try:
    # The same task and task seed every time: only config.seed changes.
    return [list(map(int, t.tokens)) for t in
            engine.run([{"start": 3, "pad": 0}], task_seeds=[11])]
  finally:
    engine.close()


def test_config_seed_drives_the_sampled_tokens(tiny_model, tokenizer, sampled_steps):
  first = _sample(tiny_model, tokenizer, sampled_steps, seed=0)
  again = _sample(tiny_model, tokenizer, sampled_steps, seed=0)
  other = _sample(tiny_model, tokenizer, sampled_steps, seed=1)
  assert first == again  # One seed repeats exactly, member by member.
  assert first[0] != first[1]  # Members of a group draw their own keys.
  assert all(a != b for a, b in zip(first, other))  # Another seed: other tokens.
