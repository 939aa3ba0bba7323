"""Programs the multi-process tests run on 2 CPU ranks, and the small models they share (``models.py``).

The tests run them as files with the repository root on ``PYTHONPATH`` (``cpu_env`` in
``tests/conftest.py``); by hand, from the repository root: ``python -m tests.scripts.fit_tiny --out r.json``.
"""
