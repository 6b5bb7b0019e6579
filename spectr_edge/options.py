"""Checks for every value that enters from outside (CLI options, API arguments): type and range,
once, where it enters. Each failure is an InputError (a ValueError) whose one line names the
field, what it got and the fix.

NumPy integers count as integers and NumPy floats as numbers; bool is never a count; a float is
never silently truncated to an integer.
"""

from __future__ import annotations

import math
import numbers
import operator
import os

from .errors import InputError


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def count(value, name: str, minimum: int = 0, fix: str = "", maximum: int | None = None) -> int:
    """An integer in [minimum, maximum]: int or NumPy integer, not bool, not float."""
    ok = not isinstance(value, bool)
    if ok:
        try:
            value = operator.index(value)
        except TypeError:
            ok = False
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if not ok or value < minimum or (maximum is not None and value > maximum):
        raise InputError(f"{name} must be an integer {bound} (got {_shown(value)})" + (f"; {fix}" if fix else ""))
    return int(value)


def number(value, name: str, fix: str = "", minimum: float | None = None, maximum: float | None = None,
           above: float | None = None) -> float:
    """A finite real number (int, float or NumPy number, not bool) with the given bounds."""
    parts = [f"> {above:g}" if above is not None else (f">= {minimum:g}" if minimum is not None else ""),
             f"<= {maximum:g}" if maximum is not None else ""]
    bound = " and ".join(p for p in parts if p)
    if above is not None and maximum is not None:
        bound = f"in ({above:g}, {maximum:g}]"
    elif minimum is not None and maximum is not None:
        bound = f"in [{minimum:g}, {maximum:g}]"
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not is_number or not math.isfinite(float(value)):
        what = "a finite number" + (f" {bound}" if bound else "")
        raise InputError(f"{name} must be {what} (got {_shown(value)})" + (f"; {fix}" if fix else ""))
    value = float(value)
    if ((minimum is not None and value < minimum) or (maximum is not None and value > maximum)
            or (above is not None and not value > above)):
        raise InputError(f"{name} must be {bound} (got {_shown(value)})" + (f"; {fix}" if fix else ""))
    return value


def flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false (got {_shown(value)})")
    return value


def token_ids(values, vocab_size: int, name: str = "prompt token id") -> list[int]:
    """Token ids: integers in [0, vocab_size) (a float id is refused, not truncated)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InputError(f"the prompt ids must be a sequence of integers (got {type(values).__name__})")
    out = []
    for value in values:
        if isinstance(value, bool):
            raise InputError(f"{name} {value!r} is a bool; pass integers in [0, {vocab_size})")
        try:
            tok = operator.index(value)
        except TypeError:
            raise InputError(f"{name} {_shown(value)} is not an integer; pass integers in [0, {vocab_size})") from None
        if not 0 <= tok < vocab_size:
            raise InputError(f"{name} {tok} is outside the vocabulary [0, {vocab_size})")
        out.append(int(tok))
    return out


def seed(value) -> int | None:
    """None or -1 (llama.cpp's spelling): a fresh random seed; else an integer >= 0."""
    if value is None:
        return None
    value = count(value, "seed", minimum=-1, fix="omit it (or pass -1) for a random seed")
    return None if value == -1 else value


def stop_strings(value) -> tuple[str, ...]:
    """One stop string or a sequence of them (a str is one stop string, never its characters)."""
    from .text import check_text

    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise InputError(f"stop must be a string or a list of strings (got {type(value).__name__})")
    return tuple(check_text(s, "a stop string") for s in value)


def threads(value) -> int | None:
    """Intra-op threads per session: None or 0 = ONNX Runtime's choice, else 1..this machine's cores."""
    if value is None:
        return None
    cores = os.cpu_count() or 1
    value = count(value, "threads", minimum=0, maximum=cores,
                  fix=f"this machine has {cores} cores; omit it (or 0) for ONNX Runtime's choice")
    return value or None
