"""Quantities written as text: ``384GiB``, ``2T``, ``500MB``, ``3M``, ``1e6``, ``10%``, one parser for all.

A quantity is a number and a suffix. Byte suffixes are the same everywhere (``KB`` is 10**3,
``KiB`` is 2**10); what a bare single letter means is the caller's: a size on the command line
reads ``2T`` as 2 TiB, a lab capacity reads ``3M`` as three million blocks or tokens.
"""

from __future__ import annotations

import re

BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
#: A bare letter on a size: binary, as memory is usually meant.
BINARY_LETTERS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: A bare letter on a count.
COUNT_LETTERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}

_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*")


class BadQuantity(ValueError):
    """Text that is not a number with an optional suffix."""


def split_quantity(text: str) -> tuple[str, float, str]:
    """``(digits, number, suffix)`` of ``text``, the suffix lower-cased; :class:`BadQuantity` if it is none."""
    match = _QUANTITY.fullmatch(text)
    if not match:
        raise BadQuantity(f"not a number with an optional unit: {text!r}")
    return match.group(1), float(match.group(1)), match.group(2).lower()


def parse_bytes(text: str) -> int:
    """``'384GiB'``, ``'2T'``, ``'500MB'`` or a plain number of bytes."""
    _, number, suffix = split_quantity(text)
    scale = BYTE_UNITS.get(suffix, BINARY_LETTERS.get(suffix))
    if scale is None:
        raise BadQuantity(f"not a size: {text!r} (try 64GiB, 2T, 500MB or a number of bytes)")
    return int(number * scale)


def size_argument(text: str) -> int:
    """A size on the command line (``'384GiB'``, ``'2T'``, ``'500MB'`` or bytes), as argparse's ``type``:
    a bad one is the parser's own error, with what was wrong."""
    import argparse

    try:
        return parse_bytes(text)
    except BadQuantity as error:
        raise argparse.ArgumentTypeError(str(error)) from None
