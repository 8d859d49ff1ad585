"""Registers `optimum-cli fp4sense ...` (read by optimum-cli at startup; kept light)."""

from fp4sense_optimum.commands import REGISTER_COMMANDS

__all__ = ["REGISTER_COMMANDS"]
