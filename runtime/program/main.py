"""`inv` / `anvil` / `python -m runtime.program.main`: make sure the .pth shim is in place, run the program."""
from __future__ import annotations

import sys

from runtime.program import pipes, shim
from runtime.program.cli import program


def main(argv=None):
    shim.ensure_installed()
    pipes.guard_stdout()
    try:
        program.run(argv)
    except BrokenPipeError:
        # `inv --list | head`: the reader left; that is not an error of ours. (pipes.guard_stdout
        # catches it in sys.stdout's writes; this is for whatever wrote to the file descriptor itself.)
        pipes.to_devnull(sys.stdout)
        sys.exit(0)


if __name__ == "__main__":
    main()
