"""YAML read as data and of bounded size: every YAML file Anvil reads goes through `load`.

yaml.safe_load constructs no objects, but it does expand aliases: a 1 KB "billion laughs"
(an anchor referenced ten times, itself made of ten references, nine levels deep) becomes
hundreds of MB. Here the document is composed first (aliases stay references, so this is
cheap), its expanded size is counted over that graph, each node once, and a document that
would expand beyond MAX_NODES values, or nests deeper than Python can follow, is refused
with YAMLTooLarge (a yaml.YAMLError, so callers' existing handling applies) before anything
is built.
"""
from __future__ import annotations

from typing import Any

import yaml

MAX_NODES = 1_000_000   # values after alias expansion: far above any config, far below a bomb


class YAMLTooLarge(yaml.YAMLError):
    """A document that would expand too far (aliases) or nests too deeply."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = None


def expanded_size(root: yaml.Node, limit: int = MAX_NODES) -> int:
    """The number of values the document has once its aliases are expanded (at most limit + 1)."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        sizes[id(node)] = min(limit + 1, 1 + sum(sizes.get(id(child), 1) for child in children))
    return sizes[id(root)]


def load(text: str | bytes, limit: int = MAX_NODES) -> Any:
    """yaml.safe_load(text), refusing a document larger than `limit` values once expanded."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YAMLTooLarge("nested too deeply to read") from None
        if node is None:
            return None
        size = expanded_size(node, limit)
        if size > limit:
            raise YAMLTooLarge(f"its aliases expand to more than {limit:,} values (an alias bomb?); "
                               f"expected a plain configuration")
        try:
            return loader.construct_document(node)
        except RecursionError:
            raise YAMLTooLarge("nested too deeply to read") from None
    finally:
        loader.dispose()
