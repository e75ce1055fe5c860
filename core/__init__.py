"""Anvil's ground floor: what every layer shares and nothing of Anvil's is imported by.

    errors.py     AnvilError and its exit codes (UserError: 2)
    files.py      atomic writes, seals, temporary folders beside their target
    signals.py    stop signals, exit statuses after them, the ranks' agreed stop
    secrets.py    masking of secrets in logs, records and snapshots
    safe_yaml.py  YAML read without object construction, duplicate keys refused

Standard library and PyYAML only at import time (torch is imported where it is used),
so the trainer, a rank, the runner and `inv --list` all load it cheaply.
"""
