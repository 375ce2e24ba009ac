"""An episode's shape, for throughput reports: how many turns, how long each piece is.

From a `Trajectory`: the prompt's tokens, each model turn's generated tokens, the tokens
between a model turn and the next (the tool's answer and the next turn's header: what
the engine prefills after a tool call), and the total. Small JSON-able numbers only; the
run logs one per sampled episode (`episodes.jsonl`, train/metrics_logger.py).
"""

from __future__ import annotations


def episode_shape(traj) -> dict:
  """{"turns", "prompt_tokens", "model_tokens": [per turn], "observation_tokens": [per turn
  followed by more tokens], "total_tokens", "end_reason", "reward"}."""
  spans = list(traj.turn_spans)
  model = [int(end - start) for start, end in spans]
  observation = []
  for i, (_, end) in enumerate(spans):
    nxt = spans[i + 1][0] if i + 1 < len(spans) else traj.length
    if nxt > end:
      observation.append(int(nxt - end))
  return {"turns": len(spans), "prompt_tokens": int(traj.prompt_length),
          "model_tokens": model, "observation_tokens": observation,
          "total_tokens": int(traj.length), "end_reason": traj.end_reason,
          "reward": float(traj.reward)}
