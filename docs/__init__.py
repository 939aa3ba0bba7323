"""The documentation: one page per feature; ``python -m docs.generate`` keeps its generated tables current."""
