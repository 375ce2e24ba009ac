"""`launch.throughput_report`: what a training run's rollouts looked like and where their
time went, and what route B would save at those lengths.

From RUN/episodes.jsonl (one shape per sampled episode) and RUN/metrics.jsonl:
  distributions  turns, model tokens per turn, observation tokens (what is prefilled
                 after a tool call), total tokens: mean, p50, p90, max
  time split     decode, prefill, env wait and host seconds summed over the RL steps, and
                 the idle share of slot-seconds (1 - busy / all)
  KV bytes       per slot at the p50 / p90 / max total length, route A's and route B's
                 cache layouts, against the slot's budget (rollout.max_len)
  route B        one decode step of each route's model, timed at the p50 and p90 lengths
                 (all slots at that length): the projected decode speed-up of B over A
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import cache as cache_lib
from agentic_rl.model import config as model_config
from agentic_rl.model import transformer
from agentic_rl.quantify import mismatch_routes
from agentic_rl.rollout import config as rollout_config
from agentic_rl.rollout.device_steps import attend_length

TIME_KEYS = ("decode", "prefill", "fork", "env_wait", "host")


def read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: not found; --workdir must be a training run's "
                            "workdir (launch.train writes it).")
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # A line cut by a kill -9 mid-write.
  return out


def distribution(values) -> dict:
  v = np.asarray(list(values), np.float64)
  if v.size == 0:
    return {"count": 0, "mean": None, "p50": None, "p90": None, "max": None}
  p50, p90 = np.percentile(v, [50, 90])
  return {"count": int(v.size), "mean": float(v.mean()), "p50": float(p50),
          "p90": float(p90), "max": float(v.max())}


def distributions(episodes: list[dict]) -> dict:
  return {"turns": distribution(e["turns"] for e in episodes),
          "model_tokens_per_turn": distribution(n for e in episodes for n in e["model_tokens"]),
          "observation_tokens": distribution(n for e in episodes
                                             for n in e["observation_tokens"]),
          "total_tokens": distribution(e["total_tokens"] for e in episodes)}


def time_split(metrics: list[dict]) -> dict:
  """Rollout seconds by bucket over the RL steps, their shares, and the idle slot share."""
  rl = [m for m in metrics if "rollout/decode_seconds" in m]
  seconds = {k: float(sum(m.get(f"rollout/{k}_seconds") or 0.0 for m in rl))
             for k in TIME_KEYS}
  total = sum(seconds.values())
  busy = sum(m.get("rollout/busy_slot_seconds") or 0.0 for m in rl)
  slots = sum(m.get("rollout/slot_seconds") or 0.0 for m in rl)
  return {"steps": len(rl), "seconds": seconds,
          "share": {k: (v / total if total else None) for k, v in seconds.items()},
          "idle_slot_share": (1.0 - busy / slots) if slots else None}


def route_specs(config) -> dict:
  """Route A's and route B's model specs and the rollout spec (capacities resolved)."""
  specs = {name: model_config.validate(mismatch_routes.ROUTES[name](config).model)
           for name in ("a", "b")}
  rollout = rollout_config.validate(config.rollout, specs["a"], seed=config.seed)
  return {**specs, "rollout": rollout}


def kv_bytes(specs: dict, lengths: dict) -> dict:
  """Cache bytes per slot at each length, per route, and the slot's budget (max_len)."""
  budget = specs["rollout"].max_len
  out = {}
  for name in ("a", "b"):
    out[name] = {k: cache_lib.cache_bytes_per_sequence(specs[name], int(n))
                 for k, n in lengths.items()}
    out[name]["budget"] = cache_lib.cache_bytes_per_sequence(specs[name], budget)
  out["budget_tokens"] = budget
  return out


def decode_step_ms(spec, slots: int, length: int, capacity: int, repeats: int = 5,
                   seed: int = 0) -> float:
  """Median wall ms of one cached decode forward of `slots` rows whose caches hold
  `length` tokens (random params and tokens: the cost does not depend on the values)."""
  model = transformer.Model(spec)
  params = model.init(jax.random.key(seed))
  tokens = jax.random.randint(jax.random.key(seed + 1), (slots, length), 0, spec.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (slots, length))
  cache = model.init_cache(slots, capacity)
  _, cache, _ = jax.jit(model.forward)(params, tokens, positions, cache)
  kv_len = attend_length(spec.block_size, length + 1, capacity)
  step = jax.jit(lambda p, t, pos, c: model.forward(p, t, pos, c, kv_len=kv_len)[0])
  tok = tokens[:, -1:]
  pos = jnp.full((slots, 1), length, jnp.int32)
  jax.block_until_ready(step(params, tok, pos, cache))  # Compile.
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, tok, pos, cache))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def projected_gain(specs: dict, lengths: dict, repeats: int = 5) -> dict:
  """Decode ms per step of route A and route B at each length; B's speed-up = A / B."""
  rollout = specs["rollout"]
  capacity = rollout.max_len
  out = {}
  for key, n in lengths.items():
    n = int(min(max(n, 1), capacity - 1))
    ms = {name: decode_step_ms(specs[name], rollout.num_slots, n, capacity, repeats)
          for name in ("a", "b")}
    out[key] = {"length": n, "route_a_ms": ms["a"], "route_b_ms": ms["b"],
                "route_b_speedup": ms["a"] / ms["b"]}
  return out


def report(workdir: str, config, *, time_routes: bool = True, repeats: int = 5) -> dict:
  episodes = read_jsonl(os.path.join(workdir, "episodes.jsonl"))
  metrics = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  if not episodes:
    raise ValueError(f"{workdir}/episodes.jsonl holds no episodes: the run has not finished "
                     "an RL step.")
  dist = distributions(episodes)
  total = dist["total_tokens"]
  lengths = {"p50": total["p50"], "p90": total["p90"], "max": total["max"]}
  specs = route_specs(config)
  out = {"workdir": workdir, "episodes": len(episodes), "distributions": dist,
         "time_split": time_split(metrics), "kv_bytes_per_slot": kv_bytes(specs, lengths)}
  if time_routes:
    out["route_b_projection"] = projected_gain(specs, {"p50": lengths["p50"],
                                                       "p90": lengths["p90"]}, repeats)
  return out


def markdown(r: dict) -> str:
  f = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
  lines = [f"# Throughput report\n\n{r['episodes']} sampled episodes of `{r['workdir']}`.", "",
           "| | count | mean | p50 | p90 | max |", "|---|---|---|---|---|---|"]
  for name, d in r["distributions"].items():
    lines.append(f"| {name} | {d['count']} | {f(d['mean'])} | {f(d['p50'])} | "
                 f"{f(d['p90'])} | {f(d['max'])} |")
  ts = r["time_split"]
  lines += ["", f"Rollout time over {ts['steps']} RL steps:", "",
            "| bucket | seconds | share |", "|---|---|---|"]
  for k in TIME_KEYS:
    lines.append(f"| {k} | {ts['seconds'][k]:.1f} | {f(ts['share'][k])} |")
  lines += ["", f"Idle slot share: {f(ts['idle_slot_share'])}", ""]
  kv = r["kv_bytes_per_slot"]
  lines += [f"KV bytes per slot (budget: {kv['budget_tokens']} tokens):", "",
            "| route | p50 | p90 | max | budget |", "|---|---|---|---|---|"]
  for name in ("a", "b"):
    lines.append(f"| {name} | " + " | ".join(str(kv[name][k])
                                             for k in ("p50", "p90", "max", "budget")) + " |")
  if "route_b_projection" in r:
    lines += ["", "Decode step, all slots at the length (ms):", "",
              "| length | route A | route B | B speed-up |", "|---|---|---|---|"]
    for p in r["route_b_projection"].values():
      lines.append(f"| {p['length']} | {p['route_a_ms']:.2f} | {p['route_b_ms']:.2f} | "
                   f"{p['route_b_speedup']:.2f}x |")
  return "\n".join(lines) + "\n"


def write_histograms(episodes: list[dict], path: str):
  """Four panels: turns, model tokens per turn, observation tokens, total tokens."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(12, 3))
  FigureCanvasAgg(fig)
  panels = (("turns", [e["turns"] for e in episodes]),
            ("model tokens per turn", [n for e in episodes for n in e["model_tokens"]]),
            ("observation tokens", [n for e in episodes for n in e["observation_tokens"]]),
            ("total tokens", [e["total_tokens"] for e in episodes]))
  for i, (title, values) in enumerate(panels):
    ax = fig.add_subplot(1, 4, i + 1)
    ax.hist(values, bins=30)
    ax.set_title(title)
    ax.set_ylabel("count")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  return fig
