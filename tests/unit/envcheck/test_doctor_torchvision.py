"""``lightning-mgpu doctor`` catches a torchvision that does not pair with torch (issue 18 item 6).

Faked environments: the installed versions come from a fake metadata reader and the import from a
fake importer, so no torchvision is needed (and none is installed here).
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest

from lightning_mgpu import envcheck
from lightning_mgpu.envcheck import packages
from lightning_mgpu.envcheck.packages import OPERATOR_ERROR, check_torchvision, fix_command, matching_torchvision


def versions(**installed: str) -> Callable[[str], Optional[str]]:
    return lambda name: installed.get(name)


def importer(error: Optional[Exception] = None) -> Callable[[str], object]:
    def load(name: str) -> object:
        if error is not None:
            raise error
        return object()

    return load


@pytest.mark.parametrize(
    ("torch", "vision"),
    [("2.13.0", "0.28.0"), ("2.4.1", "0.19.1"), ("2.0.0", "0.15.2"), ("2.13.0+cpu", "0.28.0+cpu")],
)
def test_pairs_are_ok(torch: str, vision: str) -> None:
    check = check_torchvision(version_of=versions(torch=torch, torchvision=vision), import_module=importer())
    assert check.status == "ok" and "pairs with torch" in check.value


def test_no_torchvision_is_fine() -> None:
    assert check_torchvision(version_of=versions(torch="2.13.0+cpu"), import_module=importer()).status == "ok"


def test_a_torchvision_for_another_torch_fails_with_the_install_that_fixes_it() -> None:
    check = check_torchvision(
        version_of=versions(torch="2.13.0+cpu", torchvision="0.22.1+cpu"), import_module=importer()
    )
    assert check.status == "fail"
    assert "torch 2.13.0+cpu needs 0.28.0" in check.value and "import lightning" in check.value
    assert check.fix is not None and "torchvision==0.28.0" in check.fix and "/whl/cpu" in check.fix


def test_a_cuda_torchvision_beside_a_cpu_torch_fails() -> None:
    # the registry's default torchvision (a CUDA build on Linux) next to PyTorch's CPU build
    check = check_torchvision(version_of=versions(torch="2.13.0+cpu", torchvision="0.28.0"), import_module=importer())
    assert check.status == "fail" and "torch is the +cpu build, torchvision the registry's default" in check.value
    assert check.fix == fix_command("2.13.0+cpu")


def test_the_known_operator_error_on_import_fails_even_when_the_versions_look_right() -> None:
    broken = importer(RuntimeError(f"{OPERATOR_ERROR}\nmore lines"))
    check = check_torchvision(version_of=versions(torch="2.13.0", torchvision="0.28.0"), import_module=broken)
    assert check.status == "fail" and OPERATOR_ERROR in check.value and "more lines" not in check.value
    assert check.fix is not None and "torchvision==0.28.0" in check.fix and "--index-url" not in check.fix


def test_matching_versions() -> None:
    assert matching_torchvision("2.13.0+cpu") == "0.28.0"
    assert matching_torchvision("2.5.1") == "0.20.1"
    assert matching_torchvision("1.13.1") is None
    assert "cu124" in fix_command("2.6.0+cu124")


@pytest.mark.usefixtures("no_gpu_visible")  # asserts CPU behaviour, also on a GPU machine
def test_the_doctor_reports_it_even_when_lightning_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mismatch breaks `import lightning`; the doctor must still produce its report (and the fix)."""
    failing = check_torchvision(version_of=versions(torch="2.13.0+cpu", torchvision="0.28.0"), import_module=importer())
    monkeypatch.setattr(envcheck, "check_torchvision", lambda: failing)

    def broken_versions() -> list[envcheck.Check]:
        raise RuntimeError(OPERATOR_ERROR)

    monkeypatch.setattr(envcheck, "check_versions", broken_versions)
    checks = envcheck.collect({})
    by_name = {c.name: c for c in checks}
    assert by_name["lightning"].status == "fail" and OPERATOR_ERROR in by_name["lightning"].value
    assert by_name["lightning"].fix == failing.fix
    assert by_name["torchvision"].status == "fail"
    assert envcheck.report(checks, 0.0)["status"] == "fail"


def test_the_real_environment_is_read_without_importing_anything_broken() -> None:
    check = packages.check_torchvision()
    assert check.status in ("ok", "fail")  # whatever is installed here; never an exception
