"""Module lines that forge a graded run's reply: at import, the agent's process writes
`payload` to every pipe it holds beyond stdout and stderr (the reply pipe among them)
and exits before any case runs, so the forged text is the whole reply."""


def forging_lines(payload_expr: str, prelude: tuple[str, ...] = ()) -> list[str]:
  """Lines to insert at the top of the module; `payload_expr` is Python for the bytes,
  evaluated after the `prelude` lines."""
  return [
      *prelude,
      "import os as _os, stat as _stat",
      f"_payload = {payload_expr}",
      "for _fd in range(3, 256):",
      "    try:",
      "        if _stat.S_ISFIFO(_os.fstat(_fd).st_mode):",
      "            _os.write(_fd, _payload)",
      "    except OSError:",
      "        pass",
      "_os._exit(0)",
  ]
