"""Keep `inv` ours when pip reinstalls Invoke.

Both Invoke and Anvil install a console script bin/inv; whichever package
is installed last owns the file, and `pip install --force-reinstall invoke`
silently turns `inv` back into stock Invoke (no -H, no fan-out).

Fix that survives any reinstall order: a one-line ``anvil-inv.pth`` in
site-packages. Python runs .pth import lines at start-up, when sys.argv is
already set (verified on 3.11). When the program is a script named ``inv``,
it imports this module, which makes ``invoke.main.program`` our program -
so Invoke's own script (``from invoke.main import program;
program.run()``) runs Anvil. Every other Python process pays one string
comparison. The .pth belongs to no package's RECORD, so reinstalling or
uninstalling invoke leaves it alone; `runtime.program.main.main` (every `inv` /
`anvil` start) rewrites it if it is missing, and `anvil` after a fresh
install creates it. Stock Invoke stays reachable as `invoke`.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "anvil-inv.pth"
# One line; a missing checkout must not print an error in every Python start.
PTH_LINE = ("import sys; exec('try:\\n import runtime.program.shim as m; m.redirect()\\nexcept ImportError:\\n pass') "
            "if sys.argv and sys.argv[0].replace(chr(92), '/').rsplit('/', 1)[-1] == 'inv' else None\n")


def redirect() -> None:
    """Make invoke.main.program the Anvil program (idempotent)."""
    from core import checkout
    from runtime.program import interrupts
    checkout.put_first_on_path()
    training = interrupts.install(sys.argv)   # before the program's imports, which take a while
    try:
        import invoke.main
        from runtime.program.cli import program
    except KeyboardInterrupt as stop:   # a stop signal meanwhile: one line, not a traceback out of site's .pth
        os._exit(interrupts.said(None, stop, sys.argv, training))
    invoke.main.program = program


def pth_path(purelib: str | None = None) -> Path:
    return Path(purelib or sysconfig.get_paths()["purelib"]) / PTH_NAME


def ensure_installed(purelib: str | None = None) -> bool:
    """Write the .pth if missing or stale; True if it is in place afterwards."""
    path = pth_path(purelib)
    try:
        if path.read_text() == PTH_LINE:
            return True
    except OSError:
        pass
    try:
        from core.files import write_atomic   # only when the line must be (re)written
        write_atomic(path, PTH_LINE)
        return True
    except OSError:
        return False   # read-only environment: the console script itself still works


def remove(purelib: str | None = None) -> None:
    try:
        pth_path(purelib).unlink()
    except FileNotFoundError:
        pass


if __name__ == "__main__":
    print(pth_path() if ensure_installed() else "could not write " + str(pth_path()), file=sys.stderr)
