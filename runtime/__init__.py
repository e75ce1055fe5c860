"""Anvil runtime: the inv program, launchers, fan-out, hooks, run directories, logging."""
