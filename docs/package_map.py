"""The package map: every module of ``lightning_mgpu`` with the first line of its docstring, and who imports whom.

Read from the source files with :mod:`ast` (nothing is imported), so the map in
docs/development.md is the tree as it is, not as it was when someone last wrote it down.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from docs.markdown import code, table

__all__ = ["PACKAGE", "import_graph", "modules", "package_map"]

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mgpu"

# The layers, top to bottom, as the design has them (docs/development.md): a unit may import
# units of its own layer or below. "package" is lightning_mgpu/__init__.py. A sub-package named
# here ("placement.running") is a unit of its own; its parent unit is the rest of the parent.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("package", "_registration"),
    ("callbacks", "strategies"),
    ("tuning", "placement", "whatif", "comm", "envcheck", "watch"),
    ("placement.running",),
    ("placement.planning",),
    ("_compat", "_checks", "_sizes", "_target"),
)
_UNITS = {unit for layer in LAYERS for unit in layer}


def modules(package: Path = PACKAGE) -> list[Path]:
    """Every ``.py`` file of the package, in path order."""
    return sorted(path for path in package.rglob("*.py") if "__pycache__" not in path.parts)


def _dotted(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        return "(no docstring)"
    # The first sentence may wrap: take the first paragraph, joined.
    paragraph = " ".join(line.strip() for line in doc.split("\n\n")[0].splitlines())
    # reST roles read as plain code: :class:`~.protocol.Snapshot` -> `Snapshot`
    paragraph = re.sub(r":\w+:`~([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", paragraph)
    paragraph = re.sub(r":\w+:`([^`]+)`", r"`\1`", paragraph)
    return paragraph.replace("``", "`")


def package_map(package: Path = PACKAGE) -> str:
    """One row per module: its dotted name and what its docstring says it does.

    No line counts: they change with every edit, and the map would go stale with them.
    """
    rows = [(code(_dotted(path, package)), _first_line(path)) for path in modules(package)]
    return table(("module", "its job (first paragraph of its docstring)"), rows)


def _unit(dotted: str) -> str:
    """The unit of a module of the package: ``lightning_mgpu.comm.timing`` -> ``comm``, and a sub-package that
    ``LAYERS`` names is a unit of its own: ``lightning_mgpu.placement.running.engine`` -> ``placement.running``."""
    parts = dotted.split(".")
    nested = ".".join(parts[1:3])
    return nested if nested in _UNITS else parts[1] if len(parts) > 1 else "package"


def _imports(path: Path, package: Path) -> set[str]:
    """The package's modules that ``path`` imports, at any depth of the file (lazy imports included)."""
    here = _dotted(path, package)
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here.split(".") if is_package else here.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from X import a` imports the module X.a when there is one, else a name of X.
            for alias in node.names:
                found.add(f"{stem}.{alias.name}" if _is_module(f"{stem}.{alias.name}", package) else stem)
    return {name for name in found if name == package.name or name.startswith(package.name + ".")}


def _is_module(dotted: str, package: Path) -> bool:
    relative = Path(*dotted.split("."))
    return (package.parent / relative).with_suffix(".py").is_file() or (
        package.parent / relative / "__init__.py"
    ).is_file()


def import_graph(package: Path = PACKAGE) -> str:
    """One row per top-level unit: the other units it imports, and any import against the layer order."""
    imported: dict[str, set[str]] = defaultdict(set)
    for path in modules(package):
        unit = _unit(_dotted(path, package))
        imported[unit] |= {_unit(name) for name in _imports(path, package)} - {unit}
    layer_of = {unit: depth for depth, layer in enumerate(LAYERS) for unit in layer}
    rows = []
    for unit in sorted(imported, key=lambda u: (layer_of.get(u, len(LAYERS)), u)):
        others = sorted(imported[unit])
        upward = [
            other for other in others if unit in layer_of and other in layer_of and layer_of[other] < layer_of[unit]
        ]
        rows.append(
            (
                code(unit),
                ", ".join(code(o) for o in others) or "–",
                ", ".join(code(o) for o in upward) or "none",
            )
        )
    return table(("unit", "imports from the package", "imports against the layer order"), rows)
