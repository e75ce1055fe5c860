"""Site overlays: cluster-specific settings on top of the GPU model's."""
import os
from pathlib import Path
from typing import Optional

from envs.errors import EnvError
from envs.profiles.sites import lumi

SITES = {"lumi": lumi}


def get(name: str):
    try:
        return SITES[name.lower()]
    except KeyError:
        raise EnvError(f"unknown site {name!r}; known sites: {', '.join(sorted(SITES))} (or 'none')") from None


def detect(environ=os.environ, root: Path = Path("/")) -> Optional[str]:
    """The site this machine belongs to, where that is cheap to tell; None otherwise."""
    for key, module in SITES.items():
        if module.detect(environ, root):
            return key
    return None
