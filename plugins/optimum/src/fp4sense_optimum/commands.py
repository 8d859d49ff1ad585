"""``optimum-cli fp4sense analyze | quantize | eval``: fp4sense's own commands, mounted
under optimum-cli through optimum's registration for third-party packages.

Each subcommand takes exactly the flags of the ``fp4sense`` command of the same name (the
arguments come from ``fp4sense.cli.COMMANDS``, not from a copy) and exits with its exit
code. ``fp4sense.cli`` imports nothing heavy (no torch), so optimum-cli still starts fast.
"""

from __future__ import annotations

import sys
from argparse import ArgumentParser

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

from fp4sense.cli import COMMANDS, run_command

MOUNTED = ("analyze", "quantize", "eval", "analyze-training", "train-trial")


def _leaf(name: str) -> type[BaseOptimumCLICommand]:
    """An optimum-cli command class that runs ``fp4sense NAME``."""

    def parse_args(parser: ArgumentParser) -> None:
        parser.description = COMMANDS[name].summary
        COMMANDS[name][1](parser)

    def run(self: BaseOptimumCLICommand) -> None:
        # optimum-cli ignores what run() returns: the exit code is the process's
        sys.exit(run_command(COMMANDS[name][2], self.args))

    cls_name = "FP4Sense" + name.title().replace("-", "") + "Command"
    return type(cls_name, (BaseOptimumCLICommand,),
                {"parse_args": staticmethod(parse_args), "run": run,
                 "__doc__": f"optimum-cli fp4sense {name}"})


class FP4SenseCommand(BaseOptimumCLICommand):
    """``optimum-cli fp4sense``: FP4 sensitivity diagnosis and mixed-precision planning."""

    COMMAND = CommandInfo(name="fp4sense", help="FP4 (NVFP4 / MXFP4) sensitivity diagnosis "
                          "and mixed-precision quantization (fp4sense)")
    SUBCOMMANDS = tuple(CommandInfo(name=n, help=COMMANDS[n][0], subcommand_class=_leaf(n))
                        for n in MOUNTED)


# read by optimum-cli from optimum.commands.register.register_fp4sense
REGISTER_COMMANDS = [FP4SenseCommand]
