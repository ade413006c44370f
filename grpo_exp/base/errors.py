"""Exceptions the entrypoints print as a single line: bad user input, and a run that halted itself."""


class ConfigError(ValueError):
    """A configuration value or input file is invalid; the message names the value and the fix."""


class TrainingHalted(RuntimeError):
    """Training stopped itself (a NaN/inf loss or reward); the last good checkpoint is kept."""


class DiskFullError(TrainingHalted):
    """A checkpoint or model directory could not be written for lack of disk space; what was already
    written (the last complete checkpoint, the previous model/) is kept."""
