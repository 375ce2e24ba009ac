"""An output folder that never looks complete half-written: built beside its final path as
`<name>.partial-*` and renamed into place only when everything is in it (import, export)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


def absent(out_dir: str, what: str) -> str:
  """`out_dir` made absolute; FileExistsError if something is there already."""
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir):
    raise FileExistsError(f"{out_dir} already exists: the {what} writes a new folder.")
  return out_dir


@contextlib.contextmanager
def renamed_at_the_end(out_dir: str):
  """Yields a scratch folder beside `out_dir`; renamed to it on success, removed on error."""
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".partial-", dir=parent)
  try:
    yield tmp
    os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
