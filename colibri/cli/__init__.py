"""The command line: `colibri <command>` and `colibri-convert` (`commands`), one module per command.

It imports every layer; nothing but `bench/`, `docs/` and `tests/` imports it.
"""

from colibri.cli.commands import build_parser, convert_main, main

__all__ = ["build_parser", "convert_main", "main"]
