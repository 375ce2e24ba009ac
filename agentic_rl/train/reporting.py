"""What a run reports: per-step rollout statistics, sample transcripts, the final summary
(summary.json) and its console rendering."""

from __future__ import annotations

import hashlib
import json
import math
import time

import jax
import numpy as np

from agentic_rl.envs import env as env_lib
from agentic_rl.parallel import placement
from agentic_rl.rollout import config as rollout_config_lib
from agentic_rl.train import behaviour
from agentic_rl.train.evaluation import SOLVED_REWARD, paired_gain, pass1_stderr
from agentic_rl.train.evaluator import SETTING_KEYS
from agentic_rl.train.run_state import RunState

# Logged per RL step as rollout/end_<reason> (episodes that ended so), errors included.
END_REASONS = tuple(dict.fromkeys(rollout_config_lib.END_REASONS + env_lib.END_REASONS))


def end_reason_metrics(reasons, gather=lambda x: x) -> dict:
  """rollout/end_<reason>: episodes by how they ended, one key per END_REASONS entry and
  'other', summed over processes by `gather` (a flat all-gather of each one's counts)."""
  names = END_REASONS + ("other",)
  counts = [sum(r == n for r in reasons) for n in END_REASONS]
  counts.append(len(reasons) - sum(counts))
  counts = gather(np.asarray(counts, np.int32)).reshape(-1, len(names)).sum(0)
  return {f"rollout/end_{n}": int(c) for n, c in zip(names, counts)}


def solve_stderr_by_task(task_n: np.ndarray, rewards_n: np.ndarray) -> float:
  """Stderr of the solve rate of episodes of tasks `task_n`, tasks as the unit."""
  _, inverse = np.unique(task_n, return_inverse=True)
  solved_n = (np.asarray(rewards_n, np.float64) >= SOLVED_REWARD).astype(np.float64)
  per_task_b = np.bincount(inverse, solved_n) / np.bincount(inverse)
  return pass1_stderr(per_task_b[:, None])


def tool_statistics(trajs) -> dict:
  """tools/*: calls per tool, denied and failed calls, over the step's trajectories."""
  calls, denied, errors = {}, 0, 0
  for t in trajs:
    for info in t.tool_infos:
      if not info:
        continue
      tool = info.get("tool") or "none"
      calls[tool] = calls.get(tool, 0) + 1
      denied += info.get("decision") == "denied"
      errors += info.get("decision") == "error"
  out = {f"tools/calls_{k}": v for k, v in calls.items()}
  out["tools/calls_total"] = sum(calls.values())
  out["tools/denied"] = denied
  out["tools/errors"] = errors
  return out


def params_digest(params) -> str:
  """A hash of every parameter's bytes: equal runs give equal digests."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(placement.to_host(params)):
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()


def render_trajectory(tokenizer, traj) -> str:
  """A readable transcript: the context as text, model turns marked."""
  parts = []
  pos = 0
  for n, (start, end) in enumerate(sorted(traj.turn_spans)):
    parts.append(tokenizer.decode(traj.tokens[pos:start]))
    parts.append(f"\n>>> model turn {n + 1}:\n" + tokenizer.decode(traj.tokens[start:end]))
    pos = end
  parts.append(tokenizer.decode(traj.tokens[pos:]))
  return (f"reward {traj.reward:.2f}, end: {traj.end_reason}, {traj.length} tokens\n"
          + "".join(parts))


def eval_settings_text(scores: dict) -> str:
  return ", ".join(f"{k.split('/')[-1]}={scores.get(k)}" for k in SETTING_KEYS)


def summarize(run: RunState, *, start_wall: float, params, config, comparable: bool) -> dict:
  """summary.json: the held-out gain of RL (paired per task, with its 95% interval),
  both scores, mismatch, steps and time. `comparable` says whether the start and final
  scores were drawn under the same eval settings."""
  kl = [k for k in run.mismatch_kl if math.isfinite(k)]
  start = run.heldout_sft or {}
  final = run.heldout_last or start
  gain = None
  if start.get("heldout/solves_per_task") and final.get("heldout/solves_per_task"):
    gain = paired_gain(
        np.asarray(start["heldout/solves_per_task"])[:, None]
        / start["heldout/samples_per_task"],
        np.asarray(final["heldout/solves_per_task"])[:, None]
        / final["heldout/samples_per_task"])
  return {
      **behaviour_summary(start, final),
      "heldout_gain": None if gain is None else gain["gain"],
      "heldout_gain_stderr": None if gain is None else gain["stderr"],
      "heldout_gain_ci95": None if gain is None else [gain["ci95_low"], gain["ci95_high"]],
      "heldout_episodes": final.get("heldout/episodes"),
      "heldout_stderr_sft": start.get("heldout/solve_stderr"),
      "heldout_stderr_final": final.get("heldout/solve_stderr"),
      "rl_wall_seconds": run.rl_wall_seconds,
      "heldout_solve_rate_sft": start.get("heldout/solve_rate"),
      "heldout_solve_rate_final": final.get("heldout/solve_rate"),
      "heldout_mean_reward_sft": start.get("heldout/mean_reward"),
      "heldout_mean_reward_final": final.get("heldout/mean_reward"),
      "heldout_pass_at_k_sft": start.get("heldout/pass_at_k"),
      "heldout_pass_at_k_final": final.get("heldout/pass_at_k"),
      "heldout_samples_per_task": final.get("heldout/samples_per_task"),
      # Per held-out task (the same tasks in every run of these eval settings): solves, so
      # two runs compare paired (launch/compare_runs.py).
      "heldout_solves_per_task_sft": start.get("heldout/solves_per_task"),
      "heldout_solves_per_task_final": final.get("heldout/solves_per_task"),
      "heldout_samples_per_task_sft": start.get("heldout/samples_per_task"),
      "heldout_comparable": comparable,
      "mismatch_kl_mean": float(np.mean(kl)) if kl else None,
      "mismatch_kl_max": float(np.max(kl)) if kl else None,
      "init_checkpoint": run.init_checkpoint,
      "rl_steps": run.rl_step,
      "sft_steps": run.sft_step,
      "wall_seconds": time.time() - start_wall,
      "params_sha256": params_digest(params),
      "config": json.loads(config.to_json_best_effort()),
  }


def behaviour_summary(start: dict, final: dict) -> dict:
  """Held-out behaviour before and after RL (train/behaviour.py): multi-edit share, retry
  success, wrong submits, out-of-turns, and the change of the share of solved episodes
  that needed a retry, with its 95% interval."""
  keys = [k[len("heldout/"):] for k in behaviour.behaviour_scores(
      np.zeros(len(behaviour.COUNTS), np.int64))]
  return {"heldout_behaviour_sft": {k: start.get(f"heldout/{k}") for k in keys},
          "heldout_behaviour_final": {k: final.get(f"heldout/{k}") for k in keys},
          "heldout_solved_with_retry_change": behaviour.share_change(
              start, final, "retried_solved", "solved")}


def format_summary(summary: dict) -> str:
  rows = [(k, summary.get(k)) for k in ("heldout_solve_rate_sft", "heldout_solve_rate_final",
                                        "heldout_pass_at_k_sft", "heldout_pass_at_k_final",
                                        "heldout_mean_reward_sft", "heldout_mean_reward_final",
                                        "heldout_episodes", "mismatch_kl_mean", "rl_steps",
                                        "rl_wall_seconds", "wall_seconds")]
  width = max(len(k) for k, _ in rows)
  lines = ["summary"] + [f"  {k:<{width}}  {v:.4g}" if isinstance(v, float)
                         else f"  {k:<{width}}  {v}" for k, v in rows]
  if summary.get("heldout_gain") is not None:
    low, high = summary["heldout_gain_ci95"]
    lines.append(f"held-out pass@1 {100 * summary['heldout_solve_rate_sft']:.1f}% -> "
                 f"{100 * summary['heldout_solve_rate_final']:.1f}%: gain "
                 f"{100 * summary['heldout_gain']:+.1f} points, 95% interval "
                 f"[{100 * low:+.1f}, {100 * high:+.1f}] (paired over "
                 f"{summary['heldout_episodes']} episodes)")
  before, after = summary.get("heldout_behaviour_sft"), summary.get("heldout_behaviour_final")
  if before and after and before.get("multi_edit_share") is not None:
    show = lambda d, k: "n/a" if d.get(k) is None else f"{100 * d[k]:.1f}%"
    lines.append("held-out behaviour, before -> after RL: " + "; ".join(
        f"{label} {show(before, k)} -> {show(after, k)}" for label, k in (
            ("two or more edits", "multi_edit_share"), ("retry success", "retry_success_rate"),
            ("wrong submits", "wrong_submit_share"), ("out of turns", "out_of_turns_share"))))
  change = summary.get("heldout_solved_with_retry_change")
  if change:
    lines.append(f"solved episodes that needed a retry: {100 * change['before']:.1f}% -> "
                 f"{100 * change['after']:.1f}% ({100 * change['change']:+.1f} points, 95% "
                 f"interval [{100 * change['ci95'][0]:+.1f}, {100 * change['ci95'][1]:+.1f}])")
  if summary.get("curves"):
    lines.append(f"learning curves: {summary['curves']}")
  return "\n".join(lines)
