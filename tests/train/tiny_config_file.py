"""Config file for the train-loop tests (config_flags loads configs by path)."""

import sys
import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.train.tiny_config import tiny_config  # noqa: E402


def get_config(route: str = ""):
  """`--config=tiny_config_file.py:route_a` (or `:route_b`) shrinks that route's config."""
  if not route:
    return tiny_config()
  from configs import route_a_consistency, route_b_throughput
  routes = {"route_a": route_a_consistency, "route_b": route_b_throughput}
  if route not in routes:
    raise ValueError(f"unknown route {route!r}: expected one of {sorted(routes)}")
  return tiny_config(base=routes[route].get_config())
