"""The routes `launch.measure_mismatch` compares: route A, route B and each single change
between them, as functions of the run's config.

Route A (consistency first, `train/config.route_a_config`): fp32 compute and cache, the G
layers dense, routing, blocks and sampling masks replayed. Route B (throughput first): the
config's own sparse G layers, a bf16 sampler cache, blocks chosen by sampler and learner
independently, routing replayed (configs/route_b_throughput.py). Each single change is
route A with one setting moved:

  bf16_cache         the sampler's KV cache in bfloat16 (the learner recomputes in fp32)
  sparse             the config's own G layers sparse, their blocks replayed
  no_block_replay    sparse, and the learner picks its own blocks (blocks exist only there)
  no_routing_replay  the learner routes MoE tokens itself
  no_sampling_mask   the learner ignores the sampler's top-k/top-p mask (a change only
                     when the config's sampler truncates)

In fp32 the sampler and learner pick the same experts and blocks, so replay changes little
there; the bf16 cache is where choices flip. So route B has two replay changes too:

  b_block_replay     route B with its blocks replayed
  b_no_routing_replay  route B with the learner routing MoE tokens itself

And a noisier pair, for the question replay answers: with sampler and learner both
computing in bfloat16 (route A's settings otherwise), does replaying the sampler's
choices lower the mismatch?

  bf16_compute                    model.dtype bfloat16, routing replayed
  bf16_compute_no_routing_replay  ... and the learner routes itself
  bf16_compute_sparse             ... the config's G layers sparse, blocks replayed
  bf16_compute_no_block_replay    ... and the learner picks its own blocks
"""

from __future__ import annotations

import json
from collections.abc import Callable

import ml_collections

from agentic_rl.model.families import layout
from agentic_rl.train import config as train_config_lib

# The model fields a route may change from the checkpoint's layout (a fingerprint change
# the route accepts on purpose; the base config is checked against the checkpoint first).
ROUTE_LAYOUT_FIELDS = ("layer_pattern", "cache_dtype")


def _route_a(config):
  return train_config_lib.route_a_config(config)


def _route_a_sparse(config):
  """Route A's settings with the config's own layer pattern (G layers stay sparse)."""
  out = _route_a(config)
  out.model.layer_pattern = config.model.layer_pattern
  return out


def _route_b(config):
  out = ml_collections.ConfigDict(config.to_dict())
  out.model.cache_dtype = "bfloat16"
  out.rl.replay.blocks = False
  out.rl.replay.routing = True
  out.rl.replay.sampling_mask = True
  return out


def _set(make, **fields) -> Callable:
  """`make` with dotted fields set, e.g. _set(_route_a, **{"model.cache_dtype": "bf16"});
  a field the config lacks is an error (train/config.apply_overrides)."""
  overrides = ml_collections.ConfigDict(
      layout.nest({dotted.replace(".", "/"): v for dotted, v in fields.items()}))

  def build(config):
    return train_config_lib.apply_overrides(make(config), overrides)
  return build


ROUTES: dict[str, Callable] = {
    "a": _route_a,
    "b": _route_b,
    "bf16_cache": _set(_route_a, **{"model.cache_dtype": "bfloat16"}),
    "sparse": _route_a_sparse,
    "no_block_replay": _set(_route_a_sparse, **{"rl.replay.blocks": False}),
    "no_routing_replay": _set(_route_a, **{"rl.replay.routing": False}),
    "no_sampling_mask": _set(_route_a, **{"rl.replay.sampling_mask": False}),
    "b_block_replay": _set(_route_b, **{"rl.replay.blocks": True}),
    "b_no_routing_replay": _set(_route_b, **{"rl.replay.routing": False}),
    "bf16_compute": _set(_route_a, **{"model.dtype": "bfloat16"}),
    "bf16_compute_no_routing_replay": _set(_route_a, **{"model.dtype": "bfloat16",
                                                        "rl.replay.routing": False}),
    "bf16_compute_sparse": _set(_route_a_sparse, **{"model.dtype": "bfloat16"}),
    "bf16_compute_no_block_replay": _set(_route_a_sparse, **{"model.dtype": "bfloat16",
                                                             "rl.replay.blocks": False}),
}


def parse_routes(names: str | list[str] | None) -> list[str]:
  """Route names from a comma list (None or empty: all, in ROUTES order); an unknown name
  raises, listing the valid ones."""
  if not names:
    return list(ROUTES)
  if isinstance(names, str):
    names = [n for n in names.split(",") if n.strip()]
  names = [n.strip() for n in names]
  unknown = [n for n in names if n not in ROUTES]
  if unknown:
    raise ValueError(f"--routes: unknown route(s) {unknown}; valid routes: "
                     f"{', '.join(ROUTES)}.")
  if len(set(names)) != len(names):
    raise ValueError(f"--routes={','.join(names)} names a route twice.")
  return names


def sampler_key(route_config: ml_collections.ConfigDict) -> str:
  """What the sampler's tokens depend on: the route's config without rl.replay, which only
  the learner reads (the engine records experts, blocks and masks whatever it says). Routes
  with one key sample the same trajectories, so they are scored on the same tokens."""
  d = route_config.to_dict()
  d["rl"] = {k: v for k, v in d["rl"].items() if k != "replay"}
  return json.dumps(d, sort_keys=True, default=str)


def replay_pairs(names: list[str], keys: dict[str, str], settings: dict[str, dict]
                 ) -> list[tuple[str, str, str]]:
  """(replayed, unreplayed, flag) for each two routes of `names` with one sampler key whose
  settings differ in exactly one replay flag, on in the first: the pairs whose paired
  per-token difference is replay's effect alone."""
  out = []
  for on in names:
    for off in names:
      if on == off or keys[on] != keys[off]:
        continue
      differ = [k for k in settings[on] if settings[on][k] != settings[off][k]]
      if len(differ) == 1 and differ[0].startswith("replay_") and settings[on][differ[0]]:
        out.append((on, off, differ[0]))
  return out


def route_config(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """`config` under route `name`, allowed to load the checkpoint in that route's layout."""
  out = ROUTES[parse_routes([name])[0]](config)
  allowed = tuple(out.train.allow_fingerprint_change) + ROUTE_LAYOUT_FIELDS
  out.train.allow_fingerprint_change = tuple(dict.fromkeys(allowed))
  return out
