# Two entry points, both from a clean clone on a machine with nothing installed:
#   make demo   set up, then train the flagship recipe on every device found
#               (all GPUs; 2 CPU processes over gloo when there is none)
#   make test   set up, then run the whole test suite (CI: .ci/run) on 2 pytest-xdist workers
# and the developer's loop after every edit:
#   make test-fast  the in-process tests only (tests/unit/; tests/dist/ and tests/bench/ start processes)
# TORCH picks the torch build: the default is the pinned CPU wheel; GPU users
# run e.g. `make demo TORCH=torch` (or `TORCH="torch --index-url ..."`).
PYTHON ?= python3
TORCH  ?= torch==2.13.0
VENV   ?= .venv
# Two workers, a test file at a time each (a module's fixture launches once), longest files first
# (tests/conftest.py, tests/file_seconds.json). `make test WORKERS=0` runs everything in one process.
WORKERS ?= 2
XDIST  := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile --no-loadscope-reorder)
# The in-process tests launch nothing to share: each test goes to whichever worker is free (~1 s less idle).
FAST_XDIST := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist load)
BIN    := $(VENV)/bin
# Python's bytecode cache stays on for everything started here, as in a user's shell: an environment
# that sets PYTHONDONTWRITEBYTECODE (this project's machines do) would otherwise have every one of the
# suite's ~300 processes compile the package again, and pytest rewrite every test file's asserts again
# (about 2.5 s of CPU per xdist worker before the first test). __pycache__/ is ignored by git.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev,test]"
	touch $@

demo: setup
	$(BIN)/python recipes/char_lm/train_lightning.py

# Style is checked, not trusted: ruff (lint + format) on every Python tree, mypy --strict on the package.
# mypy (about a minute of one core from a clean clone) runs beside pytest, whose 2 workers leave about
# half a core idle; its report is printed after pytest's, and either failing fails the target.
test: setup
	$(BIN)/ruff check lightning_mgpu recipes bench tests docs
	$(BIN)/ruff format --check lightning_mgpu recipes bench tests docs
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	echo "$(BIN)/mypy (beside pytest: its report follows pytest's)"; \
	$(BIN)/python -m pytest $(XDIST); tests=$$?; \
	wait $$types; typed=$$?; \
	echo "$(BIN)/mypy:"; cat $(VENV)/mypy.log; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

# tests/conftest.py fails any test here that starts a process: it belongs in tests/dist/.
test-fast: setup
	$(BIN)/python -m pytest -q $(FAST_XDIST) tests/unit

clean:
	rm -rf $(VENV) lightning_logs wandb .pytest_cache
