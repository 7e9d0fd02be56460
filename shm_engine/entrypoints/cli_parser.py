"""The command-line parser every `shm-engine` command uses: a bad argument is one line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (``prog: error: ...``, exit status 2), as the
    commands report bad values they check themselves; argparse printed its whole usage block
    (9-14 lines) above the error. ``--help`` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(prog: str, message: str, status: int = 2) -> int:
    """Report a failure found after parsing the same way; returns the exit status."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


def number(kind: type[int] | type[float], text: str) -> Any:
    """``text`` as an int or float, or the argument error that says which it should be."""
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def int_in(low: int, high: float = float("inf")) -> Callable[[str], int]:
    """An argument type: an integer in [low, high]."""

    def parse(text: str) -> int:
        value = number(int, text)
        if not low <= value <= high:
            bound = f"in {low}..{high}" if high != float("inf") else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse
