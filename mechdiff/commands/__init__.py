"""CLI subcommands; shared option groups live in `mechdiff.commands._options`."""
