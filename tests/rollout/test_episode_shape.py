"""records/episode_shape.py by hand."""

import types

from agentic_rl.records.episode_shape import episode_shape


def test_shape_of_a_two_turn_episode():
  # Prompt 0..9 (8 prompt tokens, then turn 0's header), turn 0 at 10..14, tool answer and
  # header 15..29, turn 1 at 30..32, the last tool answer 33..39.
  traj = types.SimpleNamespace(turn_spans=[(10, 15), (30, 33)], length=40, prompt_length=8,
                               end_reason="submit", reward=1.0)
  assert episode_shape(traj) == {"turns": 2, "prompt_tokens": 8, "model_tokens": [5, 3],
                                 "observation_tokens": [15, 7], "total_tokens": 40,
                                 "end_reason": "submit", "reward": 1.0}
  # A last turn cut by the token limit: nothing follows it.
  traj.length = 33
  assert episode_shape(traj)["observation_tokens"] == [15]
