"""CLI subcommands; shared option groups live in :mod:`mechdiff.commands._options`."""
