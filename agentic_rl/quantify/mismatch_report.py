"""The train-inference mismatch of each route on real rollouts (`launch.measure_mismatch`).

Per route: the engine samples the same tasks with the same seeds from the checkpoint, and
the learner scores the same tokens with its forward under the route's replay settings.
Over the generated tokens, with log r = log p_learner - log p_sampler:

  k1 = mean(-log r), k3 = mean((r - 1) - log r)      KL(sampler || learner) estimators
  |log r| mean, p50, p90, p99, max
  ratio_outside_frac                                  share of r outside [ratio_low, ratio_high]

and over every real position, routing and block agreement: the share of the sampler's
recorded experts (blocks) the learner picks too, 1 by construction where replayed. Each
figure is broken down by turn index, by position bucket (equal-width over the rollout's
max_len) and, for the agreements, by layer type. Statistics are float64 numpy on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from agentic_rl.quantify import mismatch_routes
from agentic_rl.quantify import rollouts
from agentic_rl.records.trajectory import to_batch
from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import learner
from agentic_rl.rl import mismatch
from agentic_rl.train import sft as sft_lib

SUMMARY_KEYS = ("num_tokens", "k1", "k3", "abs_logp_diff_mean", "abs_logp_diff_p50",
                "abs_logp_diff_p90", "abs_logp_diff_p99", "abs_logp_diff_max",
                "ratio_outside_frac")


def token_stats(log_r: np.ndarray, ratio_low: float = 0.5, ratio_high: float = 2.0) -> dict:
  """The log-prob figures of a set of tokens (`log_r`: log p_learner - log p_sampler);
  None for each figure of an empty set."""
  log_r = np.asarray(log_r, np.float64).ravel()
  if log_r.size == 0:
    return {"num_tokens": 0, **{k: None for k in SUMMARY_KEYS[1:]}}
  r = np.exp(log_r)
  a = np.abs(log_r)
  p50, p90, p99 = np.percentile(a, [50, 90, 99])
  return {"num_tokens": int(log_r.size), "k1": float(np.mean(-log_r)),
          "k3": float(np.mean((r - 1.0) - log_r)), "abs_logp_diff_mean": float(a.mean()),
          "abs_logp_diff_p50": float(p50), "abs_logp_diff_p90": float(p90),
          "abs_logp_diff_p99": float(p99), "abs_logp_diff_max": float(a.max()),
          "ratio_outside_frac": float(np.mean((r < ratio_low) | (r > ratio_high)))}


def grouped_stats(log_r: np.ndarray, keys: np.ndarray, **kw) -> dict:
  """token_stats per distinct key (ascending), as {str(key): stats}."""
  return {str(k): token_stats(log_r[keys == k], **kw) for k in np.unique(keys)}


def agreement_by_layer_type(sums: dict, layer_types: tuple[str, ...]) -> dict:
  """Routing and block agreement per attention layer type, from selection_agreement_sums'
  per-layer overlaps: summed counts, not a mean of per-layer shares."""
  out: dict[str, dict] = {}
  for prefix, num_key, den_key in (("routing", "layer/route_overlap", "layer/route_slots"),
                                   ("block", "layer/block_overlap", "layer/block_used")):
    if num_key not in sums:
      continue
    num, den = np.asarray(sums[num_key], np.float64), np.asarray(sums[den_key], np.float64)
    for kind in sorted(set(layer_types)):
      layers = [i for i, t in enumerate(layer_types) if t == kind]
      d = float(den[layers].sum())
      if d > 0:
        out.setdefault(kind, {})[f"{prefix}_agreement"] = float(num[layers].sum()) / d
  return out


def _agreement(sums: dict, num_key: str, den_key: str) -> float | None:
  if num_key not in sums:
    return None
  den = float(np.sum(sums[den_key]))
  return float(np.sum(sums[num_key])) / den if den > 0 else None


@dataclasses.dataclass
class RouteMeasurement:
  name: str
  settings: dict  # What the route sets: layer pattern, cache dtype, replay.
  report: dict  # The figures, with their breakdowns.
  log_r: np.ndarray  # Per generated token, for the histograms and the paired comparison.
  sampler_key: str = ""  # Routes with one key were scored on the same tokens.


def measure_route(config, name: str, checkpoint: str, num_tasks: int,
                  samples: dict | None = None) -> RouteMeasurement:
  """Samples `num_tasks` task groups of the config's env from `checkpoint` under route
  `name`, scores them with the learner, and returns the figures. With `samples` (a dict
  kept across calls, sampler key -> (route, rollouts)), a route whose sampler matches an
  earlier one's (mismatch_routes.sampler_key) is scored on that route's trajectories."""
  rc = mismatch_routes.route_config(config, name)
  key = mismatch_routes.sampler_key(rc)
  if samples is not None and key in samples:
    sampled_by, sampled = samples[key]
  else:
    sampled_by, sampled = name, rollouts.sample(rc, checkpoint, num_tasks)
    if samples is not None:
      samples[key] = (name, sampled)
  trajs, model, params = sampled.trajectories, sampled.model, sampled.params
  # Shared rollouts come with their sampling route's spec; the keys match, so only the
  # replay settings, which the learner reads, are this route's own.
  own = rl_config_lib.validate(rc.rl, rc.model, rc.rollout)
  rl_spec = dataclasses.replace(sampled.rl_spec, replay=own.replay)
  rollout_spec = sampled.rollout_spec
  longest = max(t.length for t in trajs)
  batch = to_batch(trajs, length=sft_lib.padded_length(longest, rollout_spec.max_len))
  learner.check_replay_available(batch, rl_spec, model.spec)

  @jax.jit
  def score(params, batch):
    out = learner.policy_outputs(model, params, batch, rl_spec)
    sums = {}
    if batch.replay is not None:
      sums = mismatch.selection_agreement_sums(
          out["aux"]["layers"], batch.replay, batch.positions_bt, batch.turn_index_bt,
          num_turns=rl_spec.max_turns, num_position_buckets=1,
          max_position=model.spec.max_seq_len)
    return out["logp_bt"], sums

  logp_bt, sums = jax.device_get(score(params, batch))
  on_bt = np.asarray(batch.loss_mask_bt) > 0
  log_r = (np.asarray(logp_bt, np.float64) - np.asarray(batch.sampler_logp_bt, np.float64))
  kw = dict(ratio_low=rl_spec.mismatch.ratio_low, ratio_high=rl_spec.mismatch.ratio_high)
  buckets = rl_spec.mismatch.num_position_buckets
  positions = np.asarray(batch.positions_bt)[on_bt]
  bucket = np.clip(positions * buckets // rollout_spec.max_len, 0, buckets - 1)
  width = rollout_spec.max_len / buckets
  report = {
      **token_stats(log_r[on_bt], **kw),
      "routing_agreement": _agreement(sums, "layer/route_overlap", "layer/route_slots"),
      "block_agreement": _agreement(sums, "layer/block_overlap", "layer/block_used"),
      "trajectories": len(trajs),
      "rollouts_of": sampled_by,
      "by_turn": grouped_stats(log_r[on_bt], np.asarray(batch.turn_index_bt)[on_bt], **kw),
      "by_position": {f"{int(int(b) * width)}-{int((int(b) + 1) * width)}": s
                      for b, s in grouped_stats(log_r[on_bt], bucket, **kw).items()},
      "by_layer_type": agreement_by_layer_type(sums, tuple(model.spec.layer_types)),
  }
  settings = {"layer_pattern": rc.model.layer_pattern, "cache_dtype": rc.model.cache_dtype,
              "replay_routing": bool(rl_spec.replay.routing),
              "replay_blocks": bool(rl_spec.replay.blocks),
              "replay_sampling_mask": bool(rl_spec.replay.sampling_mask),
              "sampler_truncates": bool(rl_spec.sampling_truncated)}
  return RouteMeasurement(name, settings, report, log_r[on_bt], key)


def check_checkpoint(config, checkpoint: str) -> None:
  """Loads `checkpoint` under the config itself, no layout change allowed: a checkpoint of
  another model fails here, naming the field, before any route is measured."""
  from agentic_rl.train.trainer import load_params_with
  load_params_with(config, checkpoint, "--checkpoint")


def paired_replay(on: RouteMeasurement, off: RouteMeasurement, flag: str) -> dict:
  """Replay's effect on the same tokens: `on` and `off` scored one set of trajectories,
  `flag` replayed in `on` only. Tokens where the two learners agree exactly are where the
  learner's own choice equals the sampler's; the rest carry the effect. d = |log r_off| -
  |log r_on| per token, with a normal 95% interval on its mean."""
  if on.log_r.shape != off.log_r.shape:
    raise ValueError(f"routes {on.name} and {off.name} share no tokens")
  a_on, a_off = np.abs(on.log_r), np.abs(off.log_r)
  d = a_off - a_on
  changed = on.log_r != off.log_r
  n = int(d.size)
  mean = float(d.mean()) if n else 0.0
  half = float(1.96 * d.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0
  k3 = lambda x: token_stats(x)["k3"]  # The routes' own figure, None on no tokens.
  return {"replayed": on.name, "unreplayed": off.name, "flag": flag, "num_tokens": n,
          "tokens_changed": int(changed.sum()),
          "k3_replayed": k3(on.log_r), "k3_unreplayed": k3(off.log_r),
          "k3_replayed_on_changed": k3(on.log_r[changed]),
          "k3_unreplayed_on_changed": k3(off.log_r[changed]),
          "abs_log_r_increase_mean": mean, "abs_log_r_increase_ci95": [mean - half, mean + half],
          "unreplayed_larger_on_changed": int((d[changed] > 0).sum())}


def replay_comparisons(measurements: list[RouteMeasurement]) -> list[dict]:
  """paired_replay for every pair of measured routes that shares its tokens and differs in
  one replay flag (mismatch_routes.replay_pairs)."""
  by_name = {m.name: m for m in measurements}
  pairs = mismatch_routes.replay_pairs(
      list(by_name), {m.name: m.sampler_key for m in measurements},
      {m.name: m.settings for m in measurements})
  return [paired_replay(by_name[on], by_name[off], flag) for on, off, flag in pairs]


def summary_json(measurements: list[RouteMeasurement]) -> dict[str, Any]:
  """The `--json` form: {"routes": {name: {figures..., "settings": ...}}, "replay_pairs":
  [paired_replay for each route pair that isolates one replay flag]}."""
  return {"routes": {m.name: {**m.report, "settings": m.settings} for m in measurements},
          "replay_pairs": replay_comparisons(measurements)}


def _fmt(v) -> str:
  if v is None:
    return "n/a"
  if isinstance(v, int):
    return str(v)
  return f"{v:.3g}"


def markdown(measurements: list[RouteMeasurement], header: str) -> str:
  """report.md: one row per route, then each route's breakdowns."""
  cols = ("k1", "k3", "abs_logp_diff_mean", "abs_logp_diff_p50", "abs_logp_diff_p90",
          "abs_logp_diff_p99", "abs_logp_diff_max", "ratio_outside_frac",
          "routing_agreement", "block_agreement", "num_tokens")
  lines = [header, "", "| route | " + " | ".join(cols) + " |",
           "|---" * (len(cols) + 1) + "|"]
  for m in measurements:
    lines.append(f"| {m.name} | " + " | ".join(_fmt(m.report[c]) for c in cols) + " |")
  lines += ["", "Settings:", ""]
  for m in measurements:
    lines.append(f"- {m.name}: " + ", ".join(f"{k} {v}" for k, v in m.settings.items()))
  pairs = replay_comparisons(measurements)
  if pairs:
    lines += ["", "Replay on the same tokens (each pair scored one set of trajectories; "
              "changed: tokens whose log r differs between the two):", "",
              "| replayed | unreplayed | tokens changed | k3 on changed, replayed | "
              "k3 on changed, unreplayed | mean |log r| increase [95%] |", "|---" * 6 + "|"]
    for p in pairs:
      lo, hi = p["abs_log_r_increase_ci95"]
      lines.append(f"| {p['replayed']} | {p['unreplayed']} | {p['tokens_changed']} of "
                   f"{p['num_tokens']} | {_fmt(p['k3_replayed_on_changed'])} | "
                   f"{_fmt(p['k3_unreplayed_on_changed'])} | {_fmt(p['abs_log_r_increase_mean'])}"
                   f" [{_fmt(lo)}, {_fmt(hi)}] |")
  for m in measurements:
    lines += ["", f"## {m.name}", ""]
    for scope in ("by_turn", "by_position"):
      lines += [f"| {scope} | tokens | k3 | p99 |abs logp diff| | outside |",
                "|---|---|---|---|---|"]
      for key, s in m.report[scope].items():
        lines.append(f"| {key} | {s['num_tokens']} | {_fmt(s['k3'])} | "
                     f"{_fmt(s['abs_logp_diff_p99'])} | {_fmt(s['ratio_outside_frac'])} |")
      lines.append("")
    if m.report["by_layer_type"]:
      lines += ["| layer type | routing agreement | block agreement |", "|---|---|---|"]
      for kind, s in m.report["by_layer_type"].items():
        lines.append(f"| {kind} | {_fmt(s.get('routing_agreement'))} | "
                     f"{_fmt(s.get('block_agreement'))} |")
  return "\n".join(lines) + "\n"


def write_histograms(measurements: list[RouteMeasurement], path: str):
  """One panel per route: the histogram of |log r| over log-spaced bins (zeros at the
  floor 1e-9), with the route's p99 marked. Returns the figure."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  n = len(measurements)
  cols = min(n, 4)
  rows = -(-n // cols)
  fig = Figure(figsize=(4 * cols, 3 * rows))
  FigureCanvasAgg(fig)
  bins = np.logspace(-9, 1, 41)
  for i, m in enumerate(measurements):
    ax = fig.add_subplot(rows, cols, i + 1)
    ax.hist(np.clip(np.abs(m.log_r), 1e-9, 10.0), bins=bins)
    ax.set_xscale("log")
    if m.report["abs_logp_diff_p99"] is not None:
      ax.axvline(max(m.report["abs_logp_diff_p99"], 1e-9), color="k", linestyle="--")
    ax.set_title(f"{m.name}: k3 {_fmt(m.report['k3'])}")
    ax.set_xlabel("|log p_learner - log p_sampler|")
    ax.set_ylabel("tokens")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  return fig


def write_by_turn(measurements: list[RouteMeasurement], path: str):
  """k3 by turn index, one line per route (log scale; k3 of 0 drawn at 1e-12). Returns
  the figure."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6, 4))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for m in measurements:
    turns = sorted(m.report["by_turn"], key=int)
    k3 = [max(m.report["by_turn"][t]["k3"] or 0.0, 1e-12) for t in turns]
    ax.plot([int(t) for t in turns], k3, marker="o", label=m.name)
  ax.set_yscale("log")
  ax.set_xlabel("turn index")
  ax.set_ylabel("k3 (sampler vs learner)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  return fig
