"""Checkpoint converters: `python -m convert.llada SRC OUT`."""
