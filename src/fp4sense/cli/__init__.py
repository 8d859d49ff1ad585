"""The ``fp4sense`` command line: one argument function per command (``arguments``,
reused by ``optimum-cli fp4sense``) and the actions with one error-to-exit-code mapping
(``commands``). A new command is one entry in ``commands.COMMANDS``."""

from fp4sense.cli.commands import COMMANDS, EXIT_CODES_HELP, build_parser, main, run_command

__all__ = ["COMMANDS", "EXIT_CODES_HELP", "build_parser", "main", "run_command"]
