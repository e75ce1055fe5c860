"""`inv` / `anvil` / `python -m runtime.program.main`: make sure the .pth shim is in place, run the program.

Stop signals end every task as a Ctrl-C does, with the signal's exit status (runtime/program/interrupts.py).
"""
from __future__ import annotations

import sys

from core import checkout, signals
from runtime.program import interrupts, pipes, shim


def main(argv=None):
    words = list(sys.argv if argv is None else argv)
    training = interrupts.install(words)   # first: the program's imports take a while
    program = None
    checkout.put_first_on_path()   # Anvil's kernels/, not a same-named package in site-packages
    try:
        shim.ensure_installed()
        pipes.guard_stdout()
        from runtime.program.cli import program
        program.run(argv)
    except KeyboardInterrupt as stop:       # while the program is imported
        sys.exit(interrupts.said(program, stop, words, training))
    except BrokenPipeError:
        # `inv --list | head`: the reader left; that is not an error of ours. (pipes.guard_stdout
        # catches it in sys.stdout's writes; this is for whatever wrote to the file descriptor itself.)
        pipes.to_devnull(sys.stdout)
        sys.exit(0)
    except SystemExit as exc:
        # Invoke ends a KeyboardInterrupt that reaches it with `sys.exit(1)` and no word.
        stop = exc.__context__
        if exc.code == 1 and isinstance(stop, KeyboardInterrupt):
            sys.exit(interrupts.said(program, stop, words, training))
        raise
    finally:
        signals.ignoring()    # the task's end is recorded: a late signal must not make its exit a death by signal


if __name__ == "__main__":
    main()
