"""Anvil's ground floor: what every layer shares and nothing of Anvil's is imported by.

    errors.py     AnvilError and its exit codes (UserError: 2)
    files.py      atomic writes, seals, temporary folders beside their target
    signals.py    stop signals, exit statuses after them, the ranks' agreed stop
    secrets.py    masking of secrets in logs, records and snapshots
    safe_yaml.py  YAML read without object construction, duplicate keys refused
    names.py      every name the processes share: the environment variables, the run directory's files
    runfiles.py   the one reader and writer of the run files several programs share (metrics, summary)
    host.py       this host's identity: the name the launcher reached it by
    vendor.py     the GPU vendor (amd | nvidia | cpu) and its compute platform (rocm | cuda)
    checkout.py   where the checkout is, and that its packages come first in Anvil's programs

Standard library and PyYAML only at import time (torch is imported where it is used),
so the trainer, a rank, the runner and `inv --list` all load it cheaply.
"""
