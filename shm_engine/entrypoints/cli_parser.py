"""The command-line parser every `shm-engine` command uses: a bad argument is one line."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (``prog: error: ...``, exit status 2), as the
    commands report bad values they check themselves; argparse printed its whole usage block
    (9-14 lines) above the error. ``--help`` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(prog: str, message: str) -> int:
    """Report a bad invocation found after parsing the same way; returns the exit status."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
