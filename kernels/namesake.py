"""Hugging Face's `kernels` package, carried inside this one where both are installed.

The two share the import name `kernels`, and one Python process holds one module of a name. So
where Hugging Face's is installed (transformers 5.25+ requires it), Anvil's package also carries
it: its folder is added to this package's __path__, so `kernels._internals...` and the like are
found there, and its __init__ runs to put its public names (Mode, get_kernel, kernelize, ...)
beside ours. transformers then works in a process that imported Anvil's kernels, as the test
suite does. The two packages have no module or public name in common (a test holds them so).

Programs other than Anvil's get Hugging Face's own package: the checkout comes after
site-packages on their path (core.checkout).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

DISTRIBUTION = "kernels"


def location(own_folder: Path) -> Path | None:
    """The folder of the installed `kernels` distribution's package, if it is not this checkout's."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    init = Path(dist.locate_file("kernels/__init__.py"))
    if not init.is_file() or init.resolve().parent == own_folder.resolve():
        return None
    return init.parent


def carry(package: dict) -> str | None:
    """Load the namesake into `package` (this package's globals). Returns why it could not be, or None."""
    folder = location(Path(package["__file__"]).parent)
    if folder is None:
        return None
    package["__path__"].append(str(folder))
    space = {"__name__": package["__name__"], "__package__": package["__name__"], "__path__": package["__path__"],
             "__file__": str(folder / "__init__.py"), "__builtins__": __builtins__}
    try:
        exec(compile((folder / "__init__.py").read_text(), space["__file__"], "exec"), space)
    except Exception as exc:   # its own import failed (a missing extension): Anvil's kernels still work
        package["__path__"].remove(str(folder))
        return f"{folder}: {type(exc).__name__}: {exc}"
    clash = sorted(n for n in space if not n.startswith("__") and n in package)
    if clash:
        return f"{folder}: names in both packages: {', '.join(clash)}"
    for name, value in space.items():
        if not name.startswith("__") or name == "__version__":
            package[name] = value
    return None
