"""fp4sense's commands for optimum-cli: ``optimum-cli fp4sense analyze|quantize|eval``."""

__version__ = "0.6.0"
