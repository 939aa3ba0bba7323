"""Helpers shared by test files of several lanes or areas (tests/unit, tests/dist, tests/bench): one place each."""
