"""Config file for the train-loop tests (config_flags loads configs by path)."""

import sys
import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.train.tiny_config import tiny_config  # noqa: E402


def get_config():
  return tiny_config()
