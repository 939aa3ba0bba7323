"""The test suite (a package, so that tests and scripts import ``tests.conftest`` / ``tests.scripts.models`` by one name)."""
