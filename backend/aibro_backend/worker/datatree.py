"""Data trees on the worker: arrays arrive as .npy blobs and load with allow_pickle=False."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def load_tree(tree: dict[str, Any] | None, fetch: Callable[[str], Path]) -> Any:
    if tree is None:
        return None
    if "blob" in tree:
        return np.load(fetch(tree["blob"]), allow_pickle=False)
    if "list" in tree:
        return [load_tree(t, fetch) for t in tree["list"]]
    return {k: load_tree(t, fetch) for k, t in tree["dict"].items()}
