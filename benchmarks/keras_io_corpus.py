"""keras-io's examples and guides, each run twice in a real kernel: locally, then with its one designated `.fit(...)`
(or `tuner.search(...)`) under `%%cloud_fit` / `%%cloud_tune` on the embedded backend's local-cpu machine (issue 35
item 5). Prints one row per example: trains like local / trains, differs / refused before upload / fails after
upload / local fails, with epochs, final losses and seconds, and the reason for each row that is not "trains like
local".

    python benchmarks/keras_io_corpus.py --keras-io /work/keras-io [--only vae,wgan_gp] [--json out.json]

The examples' code is not in this repository: --keras-io is a folder holding keras-io's files at their repository
paths (benchmarks/corpus/README.md says which commit of each was read, and what each recipe changes). Stand-in data
(benchmarks/corpus/standins.py) replaces every download; nothing reaches the network. Each run has a kernel, a
folder and an AIBRO_HOME of its own, so its embedded backend is private to it and stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import notebook_corpus as nc  # noqa: E402
from corpus.recipes import RECIPES, Recipe  # noqa: E402


def notebook(recipe: Recipe, keras_io: Path) -> nc.Notebook:
    """The example as cells, with its recipe applied and the stand-ins importable in the kernel."""
    source = (keras_io / recipe.path).read_text()
    text = nc.substitute(source, recipe.subs, recipe.name)
    cells = nc.drop_cells(nc.split_keras_io(text), recipe.drop, recipe.stop_after)
    setup = f"import sys\nsys.path.insert(0, {str(HERE / 'corpus')!r})\nimport standins\n{recipe.setup}"
    return nc.Notebook(
        name=recipe.name,
        cells=cells,
        call=recipe.call,
        kind=recipe.kind,
        flags=recipe.flags,
        setup=setup,
        nth=recipe.nth,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keras-io", type=Path, required=True, help="a folder with keras-io's files at their paths")
    parser.add_argument("--only", default="", help="comma-separated example names")
    parser.add_argument("--json", type=Path, default=None, help="write every outcome, in full, here")
    parser.add_argument("--keep", action="store_true", help="keep each example's folders (kernels' files, homes)")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table and reasons as Markdown here")
    args = parser.parse_args(argv)
    for var in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN"):
        os.environ.pop(var, None)
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    recipes = [r for r in RECIPES if not only or r.name in only]
    unknown = only - {r.name for r in recipes}
    if unknown:
        parser.error(f"no recipe named {sorted(unknown)}")
    outcomes: list[nc.Outcome] = []
    started = time.monotonic()
    print(f"keras-io corpus: {len(recipes)} examples, {os.cpu_count()} CPUs", flush=True)
    for i, recipe in enumerate(recipes, 1):
        root = nc.scratch_root(f"aibro-corpus-{recipe.name}-")
        t0 = time.monotonic()
        try:
            nb = notebook(recipe, args.keras_io)
            outcome = nc.run_both(nb, root, recipe.category)
        except (nc.CorpusError, OSError) as exc:
            outcome = nc.Outcome(name=recipe.name, category=recipe.category, outcome=nc.LOCAL_FAILS, reason=str(exc))
        finally:
            if not args.keep:
                nc.remove(root)
        outcomes.append(outcome)
        print(
            f"[{i}/{len(recipes)}] {recipe.name}: {outcome.outcome} ({time.monotonic() - t0:.0f} s)"
            + (f": {outcome.reason}" if outcome.reason else ""),
            flush=True,
        )
        if args.json:
            _write(args.json, outcomes, recipes, time.monotonic() - started)
    total = time.monotonic() - started
    print()
    print(nc.table(outcomes))
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"; {total / 60:.1f} min in all")
    if args.json:
        _write(args.json, outcomes, recipes, total)
    if args.markdown:
        args.markdown.write_text(markdown(outcomes, recipes, total))
    return 0


def markdown(outcomes: list[nc.Outcome], recipes: list[Recipe], seconds: float) -> str:
    """The run as Markdown: the table, then each row's reason and notes, then what each recipe changes."""
    by_name = {r.name: r for r in recipes}
    lines = [
        f"{len(outcomes)} runs over {len({by_name[o.name].path for o in outcomes})} keras-io files, "
        f"{seconds / 60:.1f} min on {os.cpu_count()} CPUs.",
        "",
        "| example | category | outcome | epochs l/r | loss local | loss remote | rel diff | s l/r |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    for o in outcomes:
        ep = "/".join("-" if e is None else str(e) for e in (o.epochs_local, o.epochs_remote))
        rel = "-" if o.loss_rel_diff is None else f"{o.loss_rel_diff:.2%}"
        lines.append(
            f"| {o.name} | {o.category} | {o.outcome} | {ep} | {num(o.loss_local)} | {num(o.loss_remote)} | {rel} | "
            f"{o.seconds_local:.0f}/{o.seconds_remote:.0f} |"
        )
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    lines += ["", ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), "", "### Reasons and notes", ""]
    for o in outcomes:
        if o.reason:
            lines.append(f"- **{o.name}** ({o.outcome}): {o.reason.replace('|', '/')}")
        for n in o.notes:
            lines.append(f"- {o.name}: note: {n}")
    lines += ["", "### Recipes: file, commit read, what changes besides data and sizes", ""]
    for r in recipes:
        if any(o.name == r.name for o in outcomes):
            lines.append(f"- **{r.name}**: `{r.path}` @ `{r.commit[:12]}`" + (f": {r.why}" if r.why else ""))
    return "\n".join(lines) + "\n"


def _write(path: Path, outcomes: list[nc.Outcome], recipes: list[Recipe], seconds: float) -> None:
    by_name = {r.name: r for r in recipes}
    rows = []
    for o in outcomes:
        d = o.as_dict()
        r = by_name[o.name]
        d.update(path=r.path, commit=r.commit, why=r.why)
        rows.append(d)
    path.write_text(json.dumps({"seconds": seconds, "outcomes": rows}, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
