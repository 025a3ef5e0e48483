"""The commands of the README's and the docs' shell blocks, as a user would copy them.

`commands` reads every fenced ``bash`` block of a Markdown file: one command per line (a
trailing ``\\`` joins lines), the ``# ...`` comment after it left out. `readme_argv` is how a test
runs one of the README's commands: it fails when the README no longer holds that command, so a
test and the line it proves cannot drift apart. tests/test_readme.py checks that a test runs
every one of them.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.S | re.M)


def _without_comment(line: str) -> str:
    """The line up to its comment: a ``#`` outside quotes that starts a word."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


@cache
def commands(path: Path = README) -> tuple[str, ...]:
    """Every command line of ``path``'s shell blocks, in order, comments left out."""
    found = []
    for block in _BLOCK.findall(path.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(_without_comment(line).split())
            if command:
                found.append(command)
    return tuple(found)


def readme_argv(command: str) -> list[str]:
    """``command``'s words, after checking that the README still gives it as written."""
    assert command in commands(), f"the README no longer holds the command {command!r}; update this test"
    return shlex.split(command)
