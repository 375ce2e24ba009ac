"""Puts the repository root on sys.path so tests import agentic_rl, configs, launch; keeps
each pytest process under the kernel's memory-map limit."""

import gc
import sys

import pytest

# XLA:CPU keeps several memory maps per compiled program while the program is cached. One
# pytest worker runs hundreds of tests: past vm.max_map_count (65530 by default) the next
# compile's mmap fails and XLA kills the worker with a segfault (seen in CI and here, in
# backend_compile_and_load, ~45k maps in by tests/rollout). After each test, once the
# process holds more than a third of the limit, JAX's caches are dropped and their maps go
# back (a module's tests can add tens of thousands, so checking per module was too late).
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def _map_count() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # No procfs: nothing to watch.
    return 0


def _map_limit() -> int:
  try:
    with open(_MAX_MAP_COUNT) as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530


_LIMIT = _map_limit()


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  yield
  jax = sys.modules.get("jax")  # A process that never imported jax compiled nothing.
  if jax is not None and _map_count() > _LIMIT // 3:
    jax.clear_caches()
    gc.collect()
