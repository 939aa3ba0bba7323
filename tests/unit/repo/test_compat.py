"""The one door for private torch/Lightning names (``lightning_mgpu/_compat/``).

1. Every private name declared there still exists in the installed torch and Lightning
   (fails loudly, naming it, when an upgrade removes one).
2. No module outside ``_compat/`` touches a private name of torch or Lightning, nor
   reaches into another object's private attributes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import lightning_mgpu
import lightning_mgpu._compat.lightning  # noqa: F401  (declares its names on import)
import lightning_mgpu._compat.python  # noqa: F401
import lightning_mgpu._compat.torch  # noqa: F401
from lightning_mgpu._compat import GUARDED, GuardedName

PACKAGE = Path(lightning_mgpu.__file__).parent
COMPAT = PACKAGE / "_compat"
EXTERNAL = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, attribute: str) -> object:
    obj: object = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def _older_than_since(entry: GuardedName) -> bool:
    """Whether the installed torch/Lightning predates the release that brought ``entry``'s name."""
    from importlib.metadata import version

    from packaging.version import Version

    if entry.since is None:
        return False
    installed = Version(version(entry.module.split(".")[0]).split("+")[0])
    return installed.release[:2] < Version(entry.since).release[:2]


@pytest.mark.parametrize("entry", GUARDED, ids=lambda e: f"{e.module}:{e.attribute}")
def test_every_guarded_private_name_still_exists(entry: GuardedName) -> None:
    try:
        _resolve(entry.module, entry.attribute)
    except (ImportError, AttributeError) as error:
        if _older_than_since(entry):
            assert not entry.required
            return  # a release before the name: its fallback runs (tested on its own where it matters)
        pytest.fail(
            f"{entry.module}.{entry.attribute} is gone from the installed torch/Lightning ({error}); "
            f"lightning_mgpu uses it for: {entry.why}. Update lightning_mgpu/_compat/ "
            f"({'no fallback exists' if entry.required else 'its fallback path now runs'}).",
        )


def test_compat_declares_names() -> None:
    assert len(GUARDED) >= 5
    assert len({(e.module, e.attribute) for e in GUARDED}) == len(GUARDED), "a private name is declared twice"


def _external_private_members() -> set[str]:
    """Underscore names that torch/Lightning base classes of our classes define or set on self."""
    names: set[str] = set()
    seen: set[type] = set()
    for module_file in PACKAGE.rglob("*.py"):
        if COMPAT in module_file.parents:
            continue
        modname = "lightning_mgpu." + ".".join(module_file.relative_to(PACKAGE).with_suffix("").parts)
        modname = modname.removesuffix(".__init__")
        try:
            module = importlib.import_module(modname)
        except Exception:  # a module that needs an optional extra: its own tests cover it
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != modname:
                continue
            for base in cls.__mro__[1:]:
                if base in seen or not base.__module__.split(".")[0] in EXTERNAL:
                    continue
                seen.add(base)
                names.update(n for n in vars(base) if _private(n))
                try:
                    source = inspect.getsource(base)
                except (OSError, TypeError):
                    continue
                names.update(n for n in re.findall(r"self\.(_\w+)\s*[:=]", source) if _private(n))
    return names


def _violations(path: Path, external_members: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    rel = path.relative_to(PACKAGE.parent)

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{rel}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in EXTERNAL:
            if any(_private(part) for part in node.module.split(".")):
                report(node, f"imports private module {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    report(node, f"imports private name {node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in EXTERNAL and any(_private(p) for p in parts):
                    report(node, f"imports private module {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            own = isinstance(base, ast.Name) and base.id in ("self", "cls")
            own = own or (isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super")
            if not own:
                label = ast.unparse(base)
                if not label.startswith("_") or "." in label:  # our own private module objects are fine
                    report(node, f"reads private attribute {label}.{node.attr}")
            elif node.attr in external_members:
                report(node, f"uses torch/Lightning's private member {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _private(arg.value):
                    report(node, f"{node.func.id}(..., {arg.value!r})")
        elif isinstance(node, ast.FunctionDef) and node.name in external_members:
            report(node, f"overrides torch/Lightning's private method {node.name}")
    return found


def test_no_private_torch_or_lightning_name_outside_compat() -> None:
    external_members = _external_private_members()
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPAT not in path.parents:
            found.extend(_violations(path, external_members))
    assert not found, "private names outside lightning_mgpu/_compat/:\n" + "\n".join(found)


def test_ddps_default_bucket_sizes_are_the_ones_the_package_assumes(one_rank_group: None) -> None:
    """``tuning.buckets`` states torch's defaults instead of reading private names: DDP itself (and torch's
    private constants, where this torch has them) must agree."""
    import torch.distributed
    from torch import nn

    from lightning_mgpu.tuning import buckets

    model = torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    assert model.bucket_bytes_cap == buckets.cap_bytes(buckets.DDP_DEFAULT_BUCKET_CAP_MB)
    first = getattr(
        torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", buckets.cap_bytes(buckets.DDP_DEFAULT_FIRST_BUCKET_MB)
    )
    assert int(first) == buckets.cap_bytes(buckets.DDP_DEFAULT_FIRST_BUCKET_MB)


def test_module_hook_dicts_exist_on_a_module() -> None:
    from torch import nn

    from lightning_mgpu._compat.torch import MODULE_HOOK_DICTS

    module = nn.Linear(2, 2)
    missing = [name for name in MODULE_HOOK_DICTS if not hasattr(module, name)]
    assert not missing, f"nn.Module no longer has {missing}: update lightning_mgpu/_compat/torch.py"


def test_installed_torch_and_lightning_are_inside_the_tested_bounds() -> None:
    """pyproject's upper bounds are the versions this suite ran against; a newer install must fail here first."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    requirements = {Requirement(r).name: Requirement(r) for r in pyproject["project"]["dependencies"]}
    for name in ("torch", "lightning"):
        spec = requirements[name].specifier
        assert any(s.operator == "<" for s in spec), f"{name} needs a tested upper bound in pyproject.toml"
        installed = version(name).split("+")[0]
        assert spec.contains(installed), f"installed {name} {installed} is outside pyproject's {spec}"


def _pyproject_bounds(name: str) -> tuple[tuple[int, ...], tuple[int, ...], set[tuple[int, ...]]]:
    """(from, to, excluded minors) of pyproject's ``name>=A,!=B.*,<C``."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    (spec,) = [Requirement(r).specifier for r in pyproject["project"]["dependencies"] if Requirement(r).name == name]
    (low,) = [Version(s.version).release for s in spec if s.operator == ">="]
    (high,) = [Version(s.version).release for s in spec if s.operator == "<"]
    excluded = {Version(s.version.removesuffix(".*")).release for s in spec if s.operator == "!="}
    assert all(s.version.endswith(".*") for s in spec if s.operator == "!="), "exclude whole minors: !=2.12.*"
    assert {s.operator for s in spec} <= {">=", "<", "!="}, f"{name}: unexpected specifier in {spec}"
    return low, high, excluded


def test_the_doctors_tested_range_is_pyprojects() -> None:
    from lightning_mgpu.envcheck.checks import EXCLUDED, SUPPORTED

    for name in ("torch", "lightning"):
        low, high, excluded = _pyproject_bounds(name)
        assert SUPPORTED[name] == (low, high), f"envcheck.checks.SUPPORTED[{name!r}] != pyproject.toml's"
        assert set(EXCLUDED.get(name, {})) == excluded, f"envcheck.checks.EXCLUDED[{name!r}] != pyproject.toml's"


def test_the_doctor_warns_about_a_torch_or_lightning_outside_the_tested_range(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning
    import torch

    from lightning_mgpu.envcheck.checks import check_versions

    checks = {c.name: c for c in check_versions()}
    assert checks["torch"].status == checks["lightning"].status == "ok"  # this suite runs inside the range

    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    monkeypatch.setattr(lightning, "__version__", "2.5.6")
    checks = {c.name: c for c in check_versions()}
    assert checks["torch"].status == "warn" and checks["torch"].value.startswith("2.4.1+cu121")
    assert checks["torch"].fix == (
        "pip install 'torch>=2.11,!=2.12.*,<2.16' (lightning_mgpu is tested on torch 2.11 to 2.15 except 2.12; "
        "2.4.1+cu121 was not run)"
    )
    assert checks["lightning"].status == "warn"
    assert checks["lightning"].fix == (
        "pip install 'lightning>=2.6,<2.7' (lightning_mgpu is tested on lightning 2.6; 2.5.6 was not run)"
    )
    for outside in ("2.16.0", "2.12.1+cpu"):
        monkeypatch.setattr(torch, "__version__", outside)
        assert {c.name: c for c in check_versions()}["torch"].status == "warn", outside
    fix = {c.name: c for c in check_versions()}["torch"].fix
    assert fix is not None and "2.12.1+cpu: a thread that ran a backward aborts the process" in fix
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert {c.name: c for c in check_versions()}["torch"].status == "ok"
