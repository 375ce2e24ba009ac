"""conftest.py's guard against the kernel's memory-map limit: what it counts, and that
dropping JAX's caches gives compiled programs' maps back (what the guard relies on)."""

import gc

import jax
import jax.numpy as jnp

import conftest


def test_compiled_programs_hold_maps_until_the_caches_are_dropped():
  jax.clear_caches()
  gc.collect()
  before = conftest._map_count()
  fns = [jax.jit(lambda x, i=i: jnp.sin(x) * i + (x @ x.T).sum()) for i in range(60)]
  for i, f in enumerate(fns):
    f(jnp.ones((4 + i % 7, 4))).block_until_ready()
  held = conftest._map_count()
  assert held > before + 60, (before, held)  # Several maps per compiled program.
  del fns
  jax.clear_caches()
  gc.collect()
  assert conftest._map_count() < before + (held - before) // 2
  assert conftest._map_limit() >= 1024
