"""fp4sense's commands for optimum-cli: ``optimum-cli fp4sense analyze|quantize|eval`` and
the FP4 training ones, ``analyze-training|train-trial``."""

__version__ = "0.6.0"
