"""Shipped files (configs, tokenizers, the base model), found from any working directory.

A relative path that starts with `configs/` names a file shipped in the `configs` package.
It resolves there in a checkout, an editable install and an installed wheel alike, unless the
working directory holds a file of that name (a user's own copy wins). Any other relative path
is the user's and resolves against the working directory. `portable` is the inverse: it turns
a shipped file's absolute path back into `configs/...`, so written configs carry no host path.
"""

from __future__ import annotations

import importlib.util
import os

SHIPPED_PACKAGE = "configs"


def shipped_root() -> str:
  """The directory that holds the `configs` package (a checkout's root or site-packages)."""
  spec = importlib.util.find_spec(SHIPPED_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        f"the '{SHIPPED_PACKAGE}' package is not importable: install the project "
        "(`pip install -e .` in the checkout) to use its shipped files.")
  return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))


def _is_shipped_name(path: str) -> bool:
  parts = os.path.normpath(path).split(os.sep)
  return len(parts) > 1 and parts[0] == SHIPPED_PACKAGE and ".." not in parts


def resolve(path: str | os.PathLike) -> str:
  """An absolute path for `path`: as given when absolute; the working directory's file when
  it exists there; the shipped file for a `configs/...` name; else relative to the cwd."""
  p = os.fspath(path)
  if not p or os.path.isabs(p):
    return p
  if os.path.exists(p) or not _is_shipped_name(p):
    return os.path.abspath(p)
  return os.path.join(shipped_root(), os.path.normpath(p))


def portable(path: str | os.PathLike) -> str:
  """`configs/...` for a file inside the shipped `configs` package; other paths unchanged."""
  p = os.fspath(path)
  if not p:
    return p
  configs_dir = os.path.join(shipped_root(), SHIPPED_PACKAGE)
  absolute = os.path.abspath(p)
  if os.path.commonpath([absolute, configs_dir]) == configs_dir:
    return os.path.relpath(absolute, shipped_root())
  return p
