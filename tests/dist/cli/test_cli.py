"""The ``lightning-mgpu`` package's lazy imports, in fresh interpreters.

``lightning-mgpu --help`` imports neither torch nor Lightning; ``import lightning_mgpu`` imports
neither, yet registers the strategy names whichever way Lightning gets imported. Help texts,
argument types and target syntax, in-process: tests/unit/cli/test_cli.py.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import REPO, cpu_env, run_python
from tests.helpers.cli import COMMANDS

HEAVY = ("torch", "lightning", "numpy", "matplotlib", "rich")


# ----------------------------------------------------------------------------- lazy imports


@pytest.mark.multiprocess  # a fresh interpreter: this one has torch loaded already
@pytest.mark.timeout(60)
def test_help_imports_neither_torch_nor_lightning() -> None:
    code = textwrap.dedent(f"""
        import sys
        from lightning_mgpu.cli import main
        for argv in [["--help"]] + [[command, "--help"] for command in {COMMANDS!r}]:
            try:
                main(argv)
            except SystemExit as exit_:
                assert exit_.code == 0, argv
        heavy = sorted(name for name in sys.modules if name.split(".")[0] in {HEAVY!r})
        print("HEAVY", heavy)
    """)
    proc = run_python(["-c", code], cwd=REPO, timeout=50, env=cpu_env())
    assert "HEAVY []" in proc.stdout, proc.stdout[-2000:]


REGISTRATION_ORDERS = {
    # import lightning_mgpu first, then Lightning, as the README's snippets do
    "package, then Lightning": "import lightning_mgpu\n"
    "assert 'torch' not in sys.modules and 'lightning' not in sys.modules\n"
    "import lightning as L\n"
    "trainer = L.Trainer(strategy='ddp_tuned', accelerator='cpu', devices=1, logger=False)\n"
    "assert type(trainer.strategy).__name__ == 'TunedDDPStrategy'\n",
    "Lightning, then package": "import lightning.pytorch\nimport lightning_mgpu\n",
    # one of our modules pulls Lightning in while it is half-initialised itself
    "a callback module first": "from lightning_mgpu.callbacks import CommProfiler\nimport lightning_mgpu\n",
    "a public class first": "import lightning_mgpu\nstrategy_class = lightning_mgpu.TunedDDPStrategy\n",
}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", list(REGISTRATION_ORDERS))
def test_import_registers_the_strategy_names_whatever_the_import_order(order: str) -> None:
    code = (
        "import sys\n" + REGISTRATION_ORDERS[order] + "from lightning.pytorch.strategies import StrategyRegistry\n"
        "import lightning_mgpu\n"
        "missing = [name for name in lightning_mgpu.STRATEGY_NAMES if name not in StrategyRegistry]\n"
        "assert missing == [], missing\n"
        "assert StrategyRegistry['hybrid']['strategy'] is lightning_mgpu.HybridParallelStrategy\n"
        "assert StrategyRegistry['ddp_tuned']['strategy'] is lightning_mgpu.TunedDDPStrategy\n"
        "from lightning_mgpu._registration import RegisterWhenLightningLoads\n"
        "assert not any(isinstance(f, RegisterWhenLightningLoads) for f in sys.meta_path), 'the finder stayed'\n"
        "print('REGISTERED')\n"
    )
    proc = run_python(["-c", code], cwd=REPO, timeout=100, env=cpu_env())
    assert "REGISTERED" in proc.stdout, proc.stdout + proc.stderr
