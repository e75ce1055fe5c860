"""`inv` / `anvil` / `python -m runtime.program.main`: make sure the .pth shim is in place, run the program."""
from __future__ import annotations

import os
import sys

from runtime.program import remote_stop, shim
from runtime.program.cli import program


def main(argv=None):
    shim.ensure_installed()
    remote_stop.watch_stdin()
    try:
        program.run(argv)
    except BrokenPipeError:
        # `inv --list | head`: the reader left; that is not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    main()
