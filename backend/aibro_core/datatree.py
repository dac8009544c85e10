"""The shape limits of a job's data tree (arrays, or lists and dicts of them), checked by the client before
anything is uploaded and by the backend at submit."""

from __future__ import annotations

from typing import Any

MAX_TREE_DEPTH = 8  # levels, an array at the top being one; Keras' nested inputs use two or three
MAX_TREE_ITEMS = 256  # entries in one list or dict
MAX_KEY_CHARS = 200  # characters in a dict key


def tree_depth(tree: Any) -> int:
    """The levels of a raw data tree ({"blob"} is one, {"dict": {"a": {"blob"}}} two), walked level by level."""
    depth, level = 0, [tree]
    while level:
        depth += 1
        below: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                kids, named = node.get("list"), node.get("dict")
                below += kids if isinstance(kids, list) else []
                below += list(named.values()) if isinstance(named, dict) else []
        level = below
    return depth
