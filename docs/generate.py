"""Rewrite the documentation's generated tables from the code and ``bench/results/``, or check that they are current.

    python -m docs.generate           rewrite every generated block in README.md and docs/*.md
    python -m docs.generate --check   exit 1 naming each stale block and each broken link

A generated block is the text between ``<!-- generated:NAME -->`` and ``<!-- /generated -->``
(each marker on a line of its own); ``NAME`` picks the function in :data:`BLOCKS` that writes
it. Edit the source (the code, or re-run the benchmark), never the block: the next run of this
command would put the source's text back. ``tests/unit/repo/test_docs.py`` runs the check in-process.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Optional

from docs import bench_tables, code_tables, hang_tables, lab_tables, package_map
from docs.markdown import heading_anchors, links

__all__ = [
    "BLOCKS",
    "REPO",
    "DocsError",
    "broken_links",
    "check",
    "documents",
    "main",
    "render",
    "stale_blocks",
    "used_blocks",
    "write_blocks",
]

REPO = Path(__file__).resolve().parents[1]

Block = Callable[[], str]

_MARKER = re.compile(
    r"^<!-- generated:(?P<name>[\w-]+) -->\n(?P<body>.*?)^<!-- /generated -->$", flags=re.MULTILINE | re.DOTALL
)


def _blocks() -> dict[str, Block]:
    blocks: dict[str, Block] = {
        "strategies": code_tables.strategies,
        "doctor-rules": code_tables.doctor_rules,
        "comm-metrics": code_tables.comm_metrics,
        "cli-commands": code_tables.cli_commands,
        "bench-headlines": bench_tables.headlines,
        "bench-overhead": bench_tables.overhead,
        "bench-profiler-overhead": bench_tables.profiler_overhead,
        "bench-profiler-breakdown": bench_tables.profiler_breakdown,
        "bench-doctor-overhead": bench_tables.doctor_overhead,
        "bench-buckets": bench_tables.buckets,
        "bench-pipeline": bench_tables.pipeline,
        "bench-planner-random": bench_tables.planner_random,
        "bench-planner-models": bench_tables.planner_models,
        "bench-planner-timing": bench_tables.planner_timing,
        "bench-comm": bench_tables.bench_comm,
        "bench-soak": bench_tables.soak,
        "bench-watch-overhead": bench_tables.watch_overhead,
        "bench-gpu-selftest": bench_tables.gpu_selftest,
        "bench-gpu-figures": bench_tables.gpu_figures,
        "lab-buckets": lab_tables.buckets,
        "lab-headlines": lab_tables.headlines,
        "lab-sweep": partial(lab_tables.sweep, "netlab_sweep"),
        "lab-sweep-1gbps-mlp": partial(lab_tables.sweep, "netlab_sweep_1gbps_mlp"),
        "lab-whatif": lab_tables.whatif_summary,
        "lab-whatif-route": lab_tables.whatif_route,
        "lab-whatif-route-parts": lab_tables.whatif_route_parts,
        "lab-whatif-slurm": partial(lab_tables.whatif_summary, "whatif_slurm"),
        "lab-whatif-slurm-route": partial(lab_tables.whatif_route, "whatif_slurm"),
        "lab-whatif-by-rate": lab_tables.whatif_by_rate,
        "lab-whatif-sources": lab_tables.whatif_sources,
        "lab-cluster-preemption": lab_tables.cluster_preemption,
        "package-map": package_map.package_map,
        "import-graph": package_map.import_graph,
    }
    blocks.update(hang_tables.blocks())
    # One block per command: a new command without a page section makes the check fail.
    for command in code_tables.command_names():
        blocks[f"cli-{command}"] = partial(code_tables.cli_flags, command)
    return blocks


BLOCKS: dict[str, Block] = _blocks()
"""Block name -> the function that writes its Markdown (without the markers)."""


class DocsError(Exception):
    """A document's markers are wrong (unknown block name, unclosed block): fix the document."""


def documents(root: Path = REPO) -> list[Path]:
    """The pages whose blocks and links are kept: README.md, docs/*.md and recipes/README.md."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "recipes" / "README.md"]
    return [page for page in pages if page.is_file()]


def render(text: str, blocks: Mapping[str, Block], *, where: str, cache: Optional[dict[str, str]] = None) -> str:
    """``text`` with every generated block rewritten; ``cache`` (name -> Markdown) spares a second call per name."""
    cache = {} if cache is None else cache
    opened = len(re.findall(r"^<!-- generated:", text, flags=re.MULTILINE))
    closed = len(_MARKER.findall(text))
    if opened != closed:
        raise DocsError(f"{where}: {opened} generated block(s) opened, {closed} closed by '<!-- /generated -->'")

    def fill(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in blocks:
            raise DocsError(f"{where}: unknown generated block {name!r}; known: {', '.join(sorted(blocks))}")
        if name not in cache:
            cache[name] = blocks[name]().strip("\n")
        return f"<!-- generated:{name} -->\n{cache[name]}\n<!-- /generated -->"

    return _MARKER.sub(fill, text)


def _relative(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def stale_blocks(root: Path = REPO, blocks: Mapping[str, Block] = BLOCKS) -> list[str]:
    """``"FILE: block NAME"`` for every generated block whose text is not what its source gives now."""
    cache: dict[str, str] = {}
    stale = []
    for page in documents(root):
        text = page.read_text()
        new = render(text, blocks, where=_relative(page, root), cache=cache)
        if new != text:
            before = {m.group("name"): m.group("body") for m in _MARKER.finditer(text)}
            after = {m.group("name"): m.group("body") for m in _MARKER.finditer(new)}
            stale += [f"{_relative(page, root)}: block {name!r}" for name in before if before[name] != after[name]]
    return stale


def write_blocks(root: Path = REPO, blocks: Mapping[str, Block] = BLOCKS) -> list[str]:
    """Rewrite the stale blocks in place; returns the files changed."""
    cache: dict[str, str] = {}
    changed = []
    for page in documents(root):
        text = page.read_text()
        new = render(text, blocks, where=_relative(page, root), cache=cache)
        if new != text:
            page.write_text(new)
            changed.append(_relative(page, root))
    return changed


def used_blocks(root: Path = REPO) -> set[str]:
    """The block names the pages use."""
    return {m.group("name") for page in documents(root) for m in _MARKER.finditer(page.read_text())}


def broken_links(root: Path = REPO) -> list[str]:
    """``"FILE:LINE: TARGET (why)"`` for every relative link that points at no file, or at no heading of a page.

    Web addresses are not followed (the check runs offline); ``#anchor`` parts are checked
    against the target page's headings.
    """
    problems = []
    for page in documents(root):
        text = page.read_text()
        for line, target in links(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.IGNORECASE):  # https:, mailto: ...
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{_relative(page, root)}:{line}: {target}"
            if not resolved.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
                problems.append(f"{where} (no heading with that anchor in {_relative(resolved, root)})")
    return problems


def check(root: Path = REPO, blocks: Mapping[str, Block] = BLOCKS) -> list[str]:
    """One line per problem: a stale block, a block no page uses, a broken link. Empty when all is well."""
    problems = [f"stale: {item}; run `python -m docs.generate` to rewrite it" for item in stale_blocks(root, blocks)]
    problems += [
        f"unused: block {name!r} appears in no page; add '<!-- generated:{name} -->' ... '<!-- /generated -->' where "
        "it belongs"
        for name in sorted(set(blocks) - used_blocks(root))
    ]
    problems += [f"broken link: {item}" for item in broken_links(root)]
    return problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m docs.generate", description="Rewrite or check the generated tables of README.md and docs/*.md."
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 naming stale blocks and broken links"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check()
            for problem in problems:
                print(problem, file=sys.stderr)
            return 1 if problems else 0
        for name in write_blocks():
            print(f"rewrote {name}")
        return 0
    except DocsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
