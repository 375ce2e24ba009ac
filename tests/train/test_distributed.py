"""Two local CPU processes (gloo collectives) run data-parallel SGD steps.

Each process feeds only its own rows; the jitted step over the global mesh
must leave both with identical params, equal to one process on all rows.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np

_WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[4])
    import jax, jax.numpy as jnp, numpy as np
    from agentic_rl.parallel import mesh as mesh_lib, mesh_config, placement
    from agentic_rl.train import distributed
    info = distributed.initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    mesh = mesh_lib.build_mesh(mesh_config.MeshSpec())
    rng = np.random.default_rng(0)
    x_all = rng.normal(size=(8, 3)).astype(np.float32)
    y_all = x_all @ np.array([1.0, -2.0, 0.5], np.float32)
    rows = list(distributed.shard_indices(8, info))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    w = placement.place(np.zeros(3, np.float32), replicated)

    @jax.jit
    def step(w, x, y):
      grad = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
      return w - 0.1 * grad

    for _ in range(5):
      x, y = placement.place_rows(mesh, (x_all[rows], y_all[rows]), info.process_count)
      w = step(w, x, y)
    local = np.asarray(w.addressable_shards[0].data)
    print(json.dumps({"process": info.process_index, "count": info.process_count,
                      "w": local.tolist()}), flush=True)
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(num_processes):
  address = f"127.0.0.1:{_free_port()}"
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", _WORKER, address, str(num_processes), str(i),
                             os.getcwd()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env) for i in range(num_processes)]
  outs = []
  for p in procs:
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]
    outs.append(json.loads(out.strip().splitlines()[-1]))
  return outs


def test_two_processes_end_with_identical_params_equal_to_one_process():
  two = _run(2)
  assert sorted(o["process"] for o in two) == [0, 1]
  assert all(o["count"] == 2 for o in two)
  np.testing.assert_array_equal(two[0]["w"], two[1]["w"])
  (one,) = _run(1)
  np.testing.assert_allclose(two[0]["w"], one["w"], rtol=1e-5, atol=1e-6)
