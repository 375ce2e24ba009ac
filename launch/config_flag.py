"""The `--config` flag every launch command shares: a config file found from any directory.

`--config configs/quickstart.py` names the shipped file (agentic_rl.resources.resolve): it
works from any working directory and from an installed package. A path to the user's own file
works as usual, and `--config.<field>=value` overrides fields as ml_collections does.
"""

from __future__ import annotations

from absl import flags
from ml_collections.config_flags import config_flags

from agentic_rl import resources


class _ResolvingParser(config_flags.ConfigFileFlagParser):
  """Resolves shipped config names before ml_collections loads the file."""

  def parse(self, path):
    file, colon, argument = path.partition(":")
    return super().parse(resources.resolve(file) + colon + argument)


def define_config(default: str, help_string: str = "Config file.",
                  name: str = "config") -> flags.FlagHolder:
  """Defines `--<name>` (a config file) with `--<name>.<field>=value` overrides."""
  flag = config_flags._ConfigFlag(  # pylint: disable=protected-access
      parser=_ResolvingParser(name=name, lock_config=True),
      serializer=flags.ArgumentSerializer(), name=name, default=default,
      help_string=help_string, flag_values=flags.FLAGS, accept_new_attributes=False)
  return flags.DEFINE_flag(flag, flags.FLAGS)
