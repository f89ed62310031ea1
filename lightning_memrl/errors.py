"""Errors a user can cause and fix: the CLI prints their message alone, without a traceback."""

from __future__ import annotations

import math


class MemRLError(Exception):
    """Base of the errors that name what the user supplied (file, row, field or option) and the fix."""


class DataError(MemRLError, ValueError):
    """A data row or file a user supplied cannot be used."""


class ConfigError(MemRLError, ValueError):
    """A configuration value is outside the range the option accepts."""


def check_option(
    name: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    why: str = "",
) -> None:
    """Raise :class:`ConfigError` naming ``name`` and the accepted range unless ``value`` lies in it.

    Args:
        name: the option as a user writes it, e.g. ``model.init_args.grpo.group_size``.
        value: its value; NaN and infinities are refused whatever the range.
        low: smallest accepted value (None: no lower bound).
        high: largest accepted value (None: no upper bound).
        low_open: ``low`` itself is refused (``> low`` instead of ``>= low``).
        high_open: ``high`` itself is refused.
        why: what the bound protects, appended to the message.
    """
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (low is None or value > low or (not low_open and value == low))
    ok = ok and (high is None or value < high or (not high_open and value == high))
    if ok:
        return
    if low is not None and high is not None:
        accepted = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        accepted = f"{'>' if low_open else '>='} {low}"
    elif high is not None:
        accepted = f"{'<' if high_open else '<='} {high}"
    else:
        accepted = "a finite number"
    raise ConfigError(f"{name} must be {accepted} (got {value!r})" + (f": {why}" if why else ""))


def find_user_error(err: BaseException) -> MemRLError | None:
    """The :class:`MemRLError` that ``err`` is or was raised from, or None.

    jsonargparse wraps an error raised while it instantiates a class or dataclass from the config
    (e.g. a ``__post_init__`` check) in its own ``ValueError``; the user's message is in the chain.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, MemRLError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def check_placeholders(*templates: tuple[str, str, tuple[str, ...]], owner: str = "workflow") -> None:
    """Stop on a prompt template that lacks a placeholder its owner fills in.

    Args:
        templates: ``(option name, template, required placeholders)`` per template.
        owner: what the options belong to, first word of the error message.
    """
    for name, template, keys in templates:
        missing = [k for k in keys if k not in template]
        if missing:
            raise ValueError(f"{owner} {name} lacks the placeholders {missing}")
