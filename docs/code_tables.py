"""Tables that mirror the package's code: strategy names, the doctor's rules, CommProfiler's metric keys, CLI flags.

Each function reads the running package, never a copy of it, so a table in the documentation
cannot say something the code does not.
"""

from __future__ import annotations

import argparse
import re

from docs.markdown import code, table

__all__ = ["cli_commands", "cli_flags", "command_names", "comm_metrics", "doctor_rules", "strategies"]


def strategies() -> str:
    """The names ``import lightning_mgpu`` puts into Lightning's ``StrategyRegistry``, read back from the registry."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_mgpu

    rows = []
    for name in StrategyRegistry.available_strategies():  # registration order
        entry = StrategyRegistry[name]
        cls = entry["strategy"]
        if not cls.__module__.startswith("lightning_mgpu."):
            continue
        public = getattr(lightning_mgpu, cls.__name__, None) is cls
        path = f"lightning_mgpu.{cls.__name__}" if public else f"{cls.__module__}.{cls.__name__}"
        options = ", ".join(code(f"{key}={value!r}") for key, value in entry["init_params"].items()) or "–"
        rows.append((code(name), entry["description"], code(path), options))
    return table(("name", "what it is", "class", "preset options"), rows)


def doctor_rules() -> str:
    """``DistributedDoctor``'s rule catalogue (``RULES``), with the meaning of each severity."""
    from lightning_mgpu.callbacks.doctor import RULES
    from lightning_mgpu.callbacks.doctor.rule import SEVERITIES

    rows = [(code(r.id), r.severity, r.catches, r.detection, r.cost, r.fix) for r in RULES.values()]
    header = ("rule", "severity", "what it catches", "how it is detected", "cost", "usual fix")
    legend = "; ".join(f"**{name}**: {meaning}" for name, meaning in SEVERITIES.items())
    return f"{table(header, rows)}\n\nSeverity: {legend}."


def comm_metrics() -> str:
    """The ``comm/...`` keys ``CommProfiler`` logs, from its ``METRICS`` (the list its docstring table is made from)."""
    from lightning_mgpu.callbacks.comm_profiler.metrics import METRICS

    rows = [(code(key), re.sub(r"``(.+?)``", r"`\1`", meaning)) for key, meaning in METRICS.items()]
    return table(("key", "meaning"), rows)


def _subcommands() -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """name -> (one-line help, parser) of every ``lightning-mgpu`` command, in ``--help`` order.

    argparse has no public way to list a parser's arguments; like sphinx-argparse, this reads
    ``_actions`` (standard library, stable since Python 3.2).
    """
    from lightning_mgpu.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return {name: (helps.get(name, ""), parser) for name, parser in action.choices.items()}
    raise RuntimeError("lightning_mgpu.cli.build_parser() has no subcommands")


def command_names() -> list[str]:
    """Every ``lightning-mgpu`` command, in ``--help`` order."""
    return list(_subcommands())


def cli_commands() -> str:
    """One row per ``lightning-mgpu`` command: what ``lightning-mgpu --help`` says it does."""
    rows = [(code(f"lightning-mgpu {name}"), help_) for name, (help_, _) in _subcommands().items()]
    return table(("command", "what it does"), rows)


def cli_flags(command: str) -> str:
    """Every argument of ``lightning-mgpu COMMAND``: its value and its help (with the default), as ``--help`` has them."""
    _, parser = _subcommands()[command]
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        meaning = _expand_help(action, parser.prog)
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs == 0:
                value = "(a switch)"
            elif action.choices is not None:
                value = " or ".join(code(choice) for choice in action.choices)
            else:
                value = code(action.metavar or action.dest.upper())
            default = action.default
            said = "default" in meaning.lower() or f"({default})" in meaning
            if action.nargs != 0 and default not in (None, argparse.SUPPRESS) and not said:
                meaning += f" (default: {default})"
            if action.required:
                meaning += " (required)"
        else:
            optional = action.nargs in ("?", "*")
            name, value = (
                str(action.metavar or action.dest.upper()),
                f"(positional, {'optional' if optional else 'required'})",
            )
        rows.append((code(name), value, meaning))
    return table(("argument", "value", "meaning"), rows)


def _expand_help(action: argparse.Action, prog: str) -> str:
    """What ``--help`` prints: argparse formats ``%(default)s`` and friends into the help text."""
    text = action.help or ""
    if "%" in text:
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        text = text % {**params, "prog": prog}
    return text
