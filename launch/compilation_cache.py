"""The JAX persistent compilation cache, on by default for the launch commands that train
or score (train, evaluate, export_base, rescore_base): a rerun, a resume or the next seed
of a seed table loads its programs from disk instead of compiling them again.

  AGENTIC_RL_COMPILATION_CACHE=DIR   cache there (default ~/.cache/agentic_rl/jax)
  AGENTIC_RL_COMPILATION_CACHE=off   no cache (benchmarks that time compiles run without)

Programs that compile in under MIN_COMPILE_SECONDS are not written; the folder is kept
under MAX_BYTES by JAX (least recently used first). The cache key includes the jax and
XLA versions and the backend, so one folder serves several installs.
"""

from __future__ import annotations

import os

ENV = "AGENTIC_RL_COMPILATION_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "agentic_rl", "jax")
MIN_COMPILE_SECONDS = 0.5
MAX_BYTES = 4 << 30
_OFF = ("0", "off", "false", "no", "none")


def enable() -> str | None:
  """Turns the cache on (unless the environment says off); returns its folder or None."""
  value = os.environ.get(ENV, "").strip()
  if value.lower() in _OFF:
    return None
  import jax  # Here, not at the top: a command's --help stays fast.

  path = os.path.abspath(os.path.expanduser(value or DEFAULT_DIR))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
  return path
