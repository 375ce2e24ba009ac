"""Config file for the train-loop tests (config_flags loads configs by path)."""

import sys
import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.train.tiny_config import tiny_config  # noqa: E402


def get_config(route: str = ""):
  """`--config=tiny_config_file.py:route_a` (or `:route_b`) shrinks that route's config."""
  if not route:
    return tiny_config()
  if route not in ("route_a", "route_b"):
    raise ValueError(f"unknown route {route!r}: expected route_a or route_b")
  import importlib
  module = importlib.import_module(f"configs.{route}_{'consistency' if route == 'route_a' else 'throughput'}")
  return tiny_config(base=module.get_config())
