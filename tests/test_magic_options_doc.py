"""Every option a magic takes is in the README: a user reads the options there, not in `%%cloud_tune?`. The two
cell magics each have an `Options:` paragraph that lists all of theirs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aibro_jupyter.magics import CloudMagics

pytestmark = pytest.mark.fast
README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def options(name: str) -> set[str]:
    found = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", getattr(CloudMagics, name).parser.format_usage())) - {"--help"}
    assert found, f"%{name} takes no options? its parser's help changed shape"
    return found


@pytest.mark.parametrize("name", ["cloud_fit", "cloud_tune"])
def test_a_cell_magic_has_an_options_paragraph_listing_all_it_takes(name: str) -> None:
    paragraphs = [p for p in README.split("\n\n") if p.startswith("Options:")]
    listed = [sorted(o for o in options(name) if f"`{o}" not in p) for p in paragraphs]
    assert [] in listed, f"no Options: paragraph of README.md lists every option of %%{name}; missing: {listed}"


@pytest.mark.parametrize("name", ["cloud_attach", "cloud_machines"])
def test_every_option_of_a_line_magic_is_in_the_readme(name: str) -> None:
    missing = sorted(o for o in options(name) if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", README))
    assert not missing, f"%{name} takes {missing}, which README.md does not mention"
