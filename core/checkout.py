"""Where Anvil's checkout is, and that its packages win over same-named ones in site-packages.

    ROOT                    # the checkout: tasks.py, runtime/, trainer/, kernels/, ... (every node has the same path)
    put_first_on_path()     # at the start of each Anvil program: inv, python -m trainer, the test suite

Anvil's top-level packages have plain names, and a package of the same name may be installed
beside them: Hugging Face's `kernels`, which transformers 5.25+ requires, is one. The editable
install makes the checkout importable after site-packages, so any other program in the
environment keeps the installed package; Anvil's own programs put the checkout first, so they
get Anvil's.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def put_first_on_path() -> None:
    root = str(ROOT)
    if not sys.path or sys.path[0] != root:
        if root in sys.path:
            sys.path.remove(root)
        sys.path.insert(0, root)
