"""The ``fp4sense`` command line: one argument function per command (``arguments``, reused
by ``optimum-cli fp4sense``) and the actions with one error-to-exit-code mapping
(``commands``; the FP4 training commands' in ``training``), its streams (``streams``:
the ``--json`` stdout, a one-line Ctrl-C or SIGTERM), and docs/cli.md's option reference
generated from the parsers (``reference``). A new command is one entry in
``commands.COMMANDS``; the options of analyze, quantize and eval are defined once in
:mod:`fp4sense.options`."""

from fp4sense.cli.commands import (
    COMMANDS,
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_VERIFY_FAILED,
    build_parser,
    main,
    run_command,
)
from fp4sense.validate import EXIT_ASSET_ERROR, EXIT_HUB_ERROR, EXIT_USER_ERROR

__all__ = ["COMMANDS", "EXIT_ASSET_ERROR", "EXIT_CODES_HELP", "EXIT_HUB_ERROR",
           "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USER_ERROR", "EXIT_VERIFY_FAILED",
           "build_parser", "main", "run_command"]
