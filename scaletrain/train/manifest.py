"""What makes a checkpoint folder complete and whole: its manifest.

``manifest.json`` lists every file of a checkpoint with its size and SHA-256.
It is written last, flushed to the disk with the folder around it, before
the folder is renamed into place (train/checkpoint.py), so a ``step_*``
folder holding a manifest is complete, and checking the files against it
tells whether they are still what was written: a truncated or altered file
is found before a resume reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to the disk (a rename is durable once its folder is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    path.write_text(text)
    fsync(path)


def entry(path: Path) -> dict[str, Any]:
    """A file's line of the manifest."""
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def share(folder: Path, rank: int, size: int) -> dict[str, dict[str, Any]]:
    """The entries of every ``size``-th file of ``folder``, from index ``rank`` on: the ranks
    that wrote a checkpoint hash it together."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    return {name: entry(folder / name) for name in names[rank::size]}


def write_manifest(folder: Path, step: int, files: dict[str, dict[str, Any]]) -> None:
    write_durably(folder / MANIFEST, json.dumps({"step": step, "files": files}, indent=2, sort_keys=True))


def verify_checkpoint(path: Path) -> None:
    """Every file the manifest lists, with its size and SHA-256; one sentence for the first that differs."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"checkpoint {path} has no readable {MANIFEST} ({type(exc).__name__}: {exc}); delete it "
                        f"to fall back to an earlier one.") from None
    for name, expected in sorted(files.items()):
        file = path / name
        problem = ("is missing" if not file.is_file() else
                   f"has {file.stat().st_size} bytes instead of {expected['bytes']}"
                   if file.stat().st_size != expected["bytes"] else
                   "does not match its SHA-256" if sha256(file) != expected["sha256"] else None)
        if problem:
            raise UserError(f"checkpoint {path} is damaged: {name} {problem}; delete the folder to fall back "
                            f"to an earlier checkpoint.")
