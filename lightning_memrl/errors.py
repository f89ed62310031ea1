"""Errors a user can cause and fix: the CLI prints their message alone, without a traceback."""

from __future__ import annotations


class MemRLError(Exception):
    """Base of the errors that name what the user supplied (file, row, field or option) and the fix."""


class DataError(MemRLError, ValueError):
    """A data row or file a user supplied cannot be used."""


class ConfigError(MemRLError, ValueError):
    """A configuration value is outside the range the option accepts."""
