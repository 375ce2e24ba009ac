"""Host tool environments: the env protocol (env.py), the registry that names them
(registry.py), the SWE suite (sandbox, permission policy, audit log, tasks, grading) and the
countdown env. Import the modules themselves: this package imports nothing on its own, so
that reading a constant from env.py does not load the sandbox or grain.
"""
