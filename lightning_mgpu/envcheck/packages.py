"""Do torch and torchvision pair? A mismatched torchvision breaks ``import lightning`` itself.

torchmetrics (which Lightning imports) imports torchvision when it is installed, and a torchvision
built for another torch fails while loading its compiled operators (``RuntimeError: operator
torchvision::nms does not exist``): a venv with ``transformers`` or ``torchvision`` from the
registry beside a CPU torch cannot even import Lightning. Two ways to pair wrong:

* **versions**: torchvision ``0.(m + 15)`` goes with torch ``2.m`` (0.15 with 2.0 ... 0.28 with 2.13);
* **builds**: the local version tag (``+cpu``, ``+cu124``, none) of each names the build; a
  CUDA torchvision (PyPI's default on Linux) beside a ``+cpu`` torch, or the other way round,
  cannot load its operators.

:func:`check_torchvision` reads the installed versions from the package metadata (no import),
then tries the import itself, and names the one command that fixes it. The metadata reader and
the importer are arguments, so tests fake an environment without installing anything.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from typing import Callable, Optional

from lightning_mgpu.envcheck.checks import Check

OPERATOR_ERROR = "operator torchvision::nms does not exist"
"""What torchvision's import raises when its compiled operators do not match the torch beside it."""
TORCH_INDEX = "https://download.pytorch.org/whl"
"""PyTorch's own package index; ``/cpu``, ``/cu124``, ... hold the builds named by the local tag."""
VISION_MINOR_OFFSET = 15
"""torchvision 0.(m + 15) pairs with torch 2.m (since torch 2.0 / torchvision 0.15)."""


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+", 1)[0])[:3])


def build_tag(version: str) -> str:
    """The build a version names: its local tag (``cpu``, ``cu124``, ``rocm6.2``), or ``""`` (the registry's default)."""
    return version.split("+", 1)[1] if "+" in version else ""


def matching_torchvision(torch_version: str) -> Optional[str]:
    """The torchvision release that pairs with ``torch_version`` (None for a torch before 2.0)."""
    release = _release(torch_version)
    if len(release) < 2 or release[0] != 2:
        return None
    patch = release[2] if len(release) > 2 else 0
    return f"0.{release[1] + VISION_MINOR_OFFSET}.{patch}"


def fix_command(torch_version: str) -> str:
    """The install command that gives a torchvision of the same release pairing and the same build."""
    vision = matching_torchvision(torch_version)
    pin = f"torchvision=={vision}" if vision else "torchvision"
    tag = build_tag(torch_version)
    index = f" --index-url {TORCH_INDEX}/{tag}" if tag else ""
    return (
        f"pip install '{pin}'{index} (the build that pairs with torch {torch_version}), "
        "or pip uninstall torchvision if nothing here needs it"
    )


def _installed(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_torchvision(
    *,
    version_of: Callable[[str], Optional[str]] = _installed,
    import_module: Callable[[str], object] = importlib.import_module,
) -> Check:
    """ok without torchvision or with one that pairs; fail, with the install command, otherwise."""
    torch_version = version_of("torch")
    vision_version = version_of("torchvision")
    if vision_version is None:
        return Check("torchvision", "ok", "not installed (Lightning does not need it)")
    if torch_version is None:
        return Check("torchvision", "warn", f"{vision_version} without torch", fix="pip install torch first")
    expected = matching_torchvision(torch_version)
    problems = []
    if expected is not None and _release(vision_version)[:2] != _release(expected)[:2]:
        problems.append(f"torchvision {vision_version} is for another torch (torch {torch_version} needs {expected})")
    if build_tag(vision_version) != build_tag(torch_version):
        builds = [
            f"+{build_tag(v)}" if build_tag(v) else "registry's default (CUDA on Linux)"
            for v in (torch_version, vision_version)
        ]
        problems.append(f"torch is the {builds[0]} build, torchvision the {builds[1]} build")
    if not problems:
        try:
            import_module("torchvision")
        except Exception as error:  # noqa: BLE001 - any failure to load it breaks `import lightning`
            text = str(error).splitlines()[0] if str(error) else type(error).__name__
            problems.append(f"import torchvision fails: {text[:160]}")
    if problems:
        why = "; ".join(problems)
        return Check(
            "torchvision",
            "fail",
            f"{vision_version} with torch {torch_version}: {why}. torchmetrics imports it, so `import lightning` fails",
            fix=fix_command(torch_version),
            details={"torch": torch_version, "torchvision": vision_version, "expected": expected},
        )
    return Check("torchvision", "ok", f"{vision_version} (pairs with torch {torch_version})")
