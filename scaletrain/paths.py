"""Checks of the paths a user gives, made before any work starts.

A path that cannot serve (missing, a file where a folder belongs or the
reverse, unreadable, unwritable, on a read-only or pseudo filesystem such as
/proc, or below a file) would otherwise fail late: after minutes of training,
in the middle of tokenizing, or while a figure is saved, with a traceback and
half a run left behind. Every command therefore checks its paths first, and
each check raises a `UserError` whose one sentence names the flag and says
what to change.

Permission bits alone do not tell whether a folder takes new files: root
passes every ``os.access`` check, yet a read-only mount or a pseudo
filesystem refuses it all the same. So a folder to be written is also
probed, by creating and removing a temporary folder in it (or in the nearest
folder that exists, under which it would be created).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from scaletrain.errors import UserError


def readable_file(flag: str, path: str | Path, wanted: str) -> Path:
    """``path`` as a Path, refused unless it is a file this user can read; ``wanted``
    (such as "a TOML file") completes the sentence that says what to give instead."""
    return _readable(flag, Path(path), wanted, files=True, folders=False)


def readable_dir(flag: str, path: str | Path, wanted: str) -> Path:
    """``path`` as a Path, refused unless it is a folder this user can list and enter."""
    return _readable(flag, Path(path), wanted, files=False, folders=True)


def readable_file_or_dir(flag: str, path: str | Path, wanted: str) -> Path:
    """``path`` as a Path, refused unless it is a readable file or a readable folder."""
    return _readable(flag, Path(path), wanted, files=True, folders=True)


def writable_dir(flag: str, path: str | Path) -> Path:
    """``path`` as a Path, refused unless it is a folder that takes new files, or
    could be created as one: its nearest existing ancestor a folder that does."""
    path = Path(path)
    if os.path.exists(path) and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a folder; give a folder path.")
    _check_creatable(flag, path, path)
    return path


def writable_file(flag: str, path: str | Path) -> Path:
    """``path`` as a Path, refused unless a file can be written there: not a folder,
    not a file this user cannot write, and its folder writable or creatable."""
    path = Path(path)
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a folder; give a file path.")
    _check_creatable(flag, path, path.parent)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path} is not writable by this user; change its permissions or give "
                        f"another path.")
    return path


def _readable(flag: str, path: Path, wanted: str, *, files: bool, folders: bool) -> Path:
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{flag} {path} does not exist; give {wanted}.") from None
    except PermissionError:  # a folder on the way denies this user entry
        raise UserError(f"{flag} {path} cannot be reached by this user (permission denied); change the "
                        f"permissions of its folders or give another path.") from None
    except OSError as exc:  # a loop of links, a name too long
        raise UserError(f"{flag} {path} cannot be read ({exc.strerror}); give {wanted}.") from None
    is_folder = stat.S_ISDIR(mode)
    if is_folder and not folders:
        raise UserError(f"{flag} {path} is a folder, not a file; give {wanted}.")
    if stat.S_ISREG(mode) and not files:
        raise UserError(f"{flag} {path} is a file, not a folder; give {wanted}.")
    if not (is_folder or stat.S_ISREG(mode)):
        raise UserError(f"{flag} {path} is neither a file nor a folder; give {wanted}.")
    # A folder is read by listing it (r) and opening what it holds (x).
    if not os.access(path, (os.R_OK | os.X_OK) if is_folder else os.R_OK):
        raise UserError(f"{flag} {path} is not readable by this user; change its permissions or give "
                        f"another path.")
    return path


def _check_creatable(flag: str, given: Path, folder: Path) -> None:
    """Refuse ``given`` unless ``folder``, or the nearest ancestor of it that exists,
    is a folder that takes new files (``given`` is what the sentence names)."""
    existing = next(p for p in (folder, *folder.parents) if os.path.exists(p))
    # The sentence's subject: the path itself, or the path and the ancestor at fault.
    where = f"{flag} {given}" if existing == given else f"{flag} {given}: {existing}"
    if not existing.is_dir():
        raise UserError(f"{where} is a file, not a folder; give a path whose parents are folders.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{where} is not writable by this user; change its permissions or choose a folder you "
                        f"can write to.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".scaletrain-probe-", dir=existing))
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise UserError(f"{where} is on a read-only filesystem; choose a folder on a writable disk.") from None
        raise UserError(f"{where} refuses new files ({exc.strerror}); choose a folder on a writable disk.") from None
