"""The documentation says what the code does: generated tables are current, links lead somewhere.

In-process and fast: nothing is launched and nothing is timed. The generator (``python -m
docs.generate``, see docs/development.md) reads the package, its CLI parsers and
``bench/results/*.json``; these tests run its check, then test the generator itself on
throw-away pages.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from docs import generate
from docs.markdown import heading_anchors, links, table
from tests.conftest import REPO

README_MOST_LINES = 220


def test_every_generated_block_is_current_and_used() -> None:
    stale = generate.stale_blocks()
    unused = sorted(set(generate.BLOCKS) - generate.used_blocks())
    assert not stale, "stale generated blocks (run `python -m docs.generate`):\n" + "\n".join(stale)
    assert not unused, f"generated blocks no page uses: {unused}; add them where they belong (docs/development.md)"


def test_every_relative_link_leads_to_a_file_and_heading() -> None:
    broken = generate.broken_links()
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_page() -> None:
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MOST_LINES, f"README.md has {lines} lines; keep it a front page and move detail to docs/"


def test_every_test_a_page_names_exists() -> None:
    missing = []
    for page in generate.documents():
        for file, name in re.findall(r"(tests/(?:\w+/)*test_\w+\.py)(?:::(test_\w+))?", page.read_text()):
            path = REPO / file
            if not path.is_file() or (name and not re.search(rf"^def {name}\(", path.read_text(), flags=re.MULTILINE)):
                missing.append(f"{page.relative_to(REPO)}: {file}{'::' + name if name else ''}")
    assert not missing, "pages name tests that do not exist:\n" + "\n".join(missing)


def _argument_rows(page: Path) -> list[str]:
    """The argument names in the first column of the page's ``| argument | ...`` tables."""
    names, in_table = [], False
    for line in page.read_text().splitlines():
        if line.startswith("| argument |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and not line.startswith("|---"):
            match = re.match(r"\| `(\w+)", line)
            if match:  # "any other keyword", "others": no name
                names.append(match.group(1))
    return names


def _documented_classes() -> list[tuple[str, type, bool]]:
    import lightning_mgpu

    # (page, class, whether the page's table lists every argument of the class)
    return [
        ("strategies.md", lightning_mgpu.TunedDDPStrategy, False),  # Lightning's DDP options pass through
        ("hybrid.md", lightning_mgpu.HybridParallelStrategy, True),
        ("comm_profiler.md", lightning_mgpu.CommProfiler, True),
        ("doctor.md", lightning_mgpu.DistributedDoctor, True),
    ]


@pytest.mark.parametrize("page", ["strategies.md", "hybrid.md", "comm_profiler.md", "doctor.md"])
def test_argument_tables_name_the_class_arguments(page: str) -> None:
    (cls, complete) = next((c, full) for p, c, full in _documented_classes() if p == page)
    parameters = inspect.signature(cls).parameters
    documented = _argument_rows(REPO / "docs" / page)
    assert documented, f"docs/{page} has no argument table"
    twice = sorted({name for name in documented if documented.count(name) > 1})
    assert not twice, f"docs/{page} documents {twice} more than once"
    unknown = [name for name in documented if name not in parameters]
    assert not unknown, f"docs/{page} documents {unknown}, which {cls.__name__} does not take"
    if complete:
        plain = [n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        undocumented = [name for name in plain if name not in documented and name not in _deprecated(page)]
        assert not undocumented, f"docs/{page} leaves out {undocumented} of {cls.__name__}"


def _deprecated(page: str) -> set[str]:
    # Old names kept for compatibility are mentioned beside their new name, not given a row.
    return {"every_n_steps"} if page == "doctor.md" else set()


# ----------------------------------------------------------------------------- the generator itself


def _site(root: Path, readme: str, page: str) -> None:
    (root / "docs").mkdir()
    (root / "README.md").write_text(readme)
    (root / "docs" / "page.md").write_text(page)


def test_a_stale_block_is_named_then_rewritten(tmp_path: Path) -> None:
    _site(
        tmp_path,
        "# Front\n\n[page](docs/page.md#rules)\n",
        "# Page\n\n## Rules\n\n<!-- generated:rules -->\nold\n<!-- /generated -->\n",
    )
    blocks = {"rules": lambda: table(("rule",), [("`a`",), ("`b`",)])}
    assert generate.stale_blocks(tmp_path, blocks) == ["docs/page.md: block 'rules'"]
    assert generate.check(tmp_path, blocks) == [
        "stale: docs/page.md: block 'rules'; run `python -m docs.generate` to rewrite it"
    ]
    assert generate.write_blocks(tmp_path, blocks) == ["docs/page.md"]
    assert generate.check(tmp_path, blocks) == []
    assert "| `b` |\n<!-- /generated -->" in (tmp_path / "docs" / "page.md").read_text()
    assert generate.write_blocks(tmp_path, blocks) == []  # nothing left to do


def test_a_block_no_page_uses_and_a_broken_link_are_reported(tmp_path: Path) -> None:
    _site(tmp_path, "[gone](docs/missing.md) [anchor](docs/page.md#nowhere) [web](https://example.org)\n", "# Page\n")
    problems = generate.check(tmp_path, {"orphan": lambda: "x"})
    assert problems[0].startswith("unused: block 'orphan'")
    assert problems[1:] == [
        "broken link: README.md:1: docs/missing.md (no such file)",
        "broken link: README.md:1: docs/page.md#nowhere (no heading with that anchor in docs/page.md)",
    ]


@pytest.mark.parametrize(
    ("page", "error"),
    [
        ("<!-- generated:nope -->\n<!-- /generated -->\n", "unknown generated block 'nope'"),
        ("<!-- generated:rules -->\nnever closed\n", "1 generated block(s) opened, 0 closed"),
    ],
)
def test_a_malformed_page_is_an_error_naming_it(tmp_path: Path, page: str, error: str) -> None:
    _site(tmp_path, "# Front\n", page)
    with pytest.raises(generate.DocsError, match=re.escape(f"docs/page.md: {error}")):
        generate.check(tmp_path, {"rules": lambda: "x"})


def test_links_in_code_are_not_links_and_anchors_follow_github() -> None:
    text = "# A `code` title: here\n\n```\n[not](a-link.md)\n```\n`[nor](this.md)` but [this](b.md#x) ![img](c.png)\n## Twice\n## Twice\n"
    assert links(text) == [(6, "b.md#x"), (6, "c.png")]
    assert heading_anchors(text) == {"a-code-title-here", "twice", "twice-1"}


def test_table_cells_cannot_break_the_table() -> None:
    assert (
        table(("a", "b"), [("x | y", "line\nbreak")], right=(1,))
        == "| a | b |\n| --- | ---: |\n| x \\| y | line break |"
    )
