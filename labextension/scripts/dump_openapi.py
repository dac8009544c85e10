"""Write the backend's OpenAPI document to labextension/openapi.json, without starting a server.

`jlpm build` runs this first; then openapi_types.mjs turns the document into labextension/src/generated/openapi.ts,
the types api.ts reads every answer with, so a change to the backend's bodies that the TypeScript does not follow
fails the build.

The document is committed (it is deterministic: sorted keys, no timestamps). `pip install` builds the labextension in
an isolated environment, before the project's own dependencies are installed, where the backend may not import:
then this says so and the committed document is used. tests/test_openapi_types.py keeps it equal to the backend's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "labextension" / "openapi.json"


def render() -> str:
    """The document as committed: the backend in this checkout, not whichever one is installed."""
    if str(ROOT / "backend") not in sys.path:
        sys.path.insert(0, str(ROOT / "backend"))
    from aibro_backend.api.openapi import document

    return json.dumps(document(), indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def _in_pip_isolation() -> bool:
    """pip's build isolation: PYTHONPATH holds only its sitecustomize, which hides the real site-packages."""
    path = os.environ.get("PYTHONPATH", "")
    return bool(path) and os.environ.get("PYTHONNOUSERSITE") == "1" and (Path(path) / "sitecustomize.py").exists()


def main() -> int:
    try:
        text = render()
    except ImportError as exc:
        if _in_pip_isolation():  # the same interpreter, with the site-packages the project was installed into
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
            os.execve(sys.executable, [sys.executable, __file__], env)
        if not OUT.exists():
            print(f"dump_openapi: cannot import the backend ({exc}) and {OUT} is missing", file=sys.stderr)
            return 1
        print(
            f"dump_openapi: the backend does not import here ({exc}); the types come from the committed "
            f"{OUT.relative_to(ROOT)}",
            file=sys.stderr,
        )
        return 0
    if not OUT.exists() or OUT.read_text() != text:  # unchanged: keep the mtime, so hatch sees no new source
        OUT.write_text(text)
        print(f"dump_openapi: wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
