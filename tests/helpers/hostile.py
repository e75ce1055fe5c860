"""Input made to stall Anvil: YAML that expands without bound (the "billion laughs")."""
from __future__ import annotations

import string


def alias_bomb(levels: int, width: int) -> str:
    """YAML of `levels` anchored lists, the first of `width` words, each after it of `width` aliases of the
    one before: width ** levels values once expanded, from a few hundred bytes."""
    names = string.ascii_lowercase[:levels]
    lines = [f"a: &a [{', '.join(['lol'] * width)}]"]
    lines += [f"{name}: &{name} [{', '.join([f'*{before}'] * width)}]" for before, name in zip(names, names[1:])]
    return "\n".join(lines) + "\n"
