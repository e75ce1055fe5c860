"""The far end of Ctrl-C under `inv -H`: an `inv` started by a fan-out stops when its stdin ends.

runtime.cluster.ssh starts each host's task as ``ANVIL_STOP_AT_EOF=1 inv TASK``
with an SSH channel for stdin that carries nothing. On Ctrl-C it closes that
stdin; a dropped connection closes it too. The remote `inv` then sends SIGINT
to its own process group (sshd gives every session its own), which is what a
terminal's Ctrl-C does: the task and its children end as they would here, and
the host reports how.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import MutableMapping

ENV = "ANVIL_STOP_AT_EOF"


def watch_stdin(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Start the watcher when the fan-out asked for it (once: the variable is not passed on)."""
    if environ.pop(ENV, "") != "1":
        return False
    threading.Thread(target=_wait_for_end, name="anvil-stdin-end", daemon=True).start()
    return True


def _wait_for_end() -> None:
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        return      # no stdin to watch
    os.killpg(os.getpgrp(), signal.SIGINT)
