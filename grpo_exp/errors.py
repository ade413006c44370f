"""The one exception type for bad user input, printed as a single line by the entrypoints."""


class ConfigError(ValueError):
    """A configuration value or input file is invalid; the message names the value and the fix."""
