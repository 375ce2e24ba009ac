"""Puts the repository root on sys.path so tests import agentic_rl, configs, launch."""
