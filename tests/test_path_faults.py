"""Every path flag of every command against every fault that applies to it: exit code 2, one
line on stderr that begins with the flag, no traceback, and nothing left behind.

Each row is a command line whose only mistake is one path (the other flags valid), built from
the kind of path the flag wants: a file or folder to read, a folder or file to write. The rows
run in this process through ``scaletrain.commands.cli.main``. Permission bits do not stop root, so the
rows about permissions run, when the tests run as root, together in one child process that
becomes the user nobody first; it imports what the commands need before it does, since the
interpreter may live where nobody cannot read.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from scaletrain.commands.cli import main

TINY = ("--model", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--steps", "3", "--warmup-steps", "1",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress")
# The valid command lines, {tmp} the row's folder and {corpus} a text file; a row appends its flag
# (a repeated flag's last value wins). finetune's --from only has to get past the parser.
TRAIN_FLAGS = (*TINY, "--data", "{corpus}", "--cache-dir", "{tmp}/cache")
COMMANDS = {
    "train": ("train", *TRAIN_FLAGS, "--out", "{tmp}/run"),
    "finetune": ("finetune", *TRAIN_FLAGS, "--out", "{tmp}/run", "--from", "{tmp}/base"),
    "parity": ("parity", *TRAIN_FLAGS),
    "bench": ("bench", "techniques", "--warmup", "1", *TRAIN_FLAGS),
    "bench allreduce": ("bench", "allreduce", "--nproc", "2", "--steps", "1", "--warmup", "0"),
    "schedule": ("schedule",),
    "plan": ("plan", "--gpus", "2"),
    "export": ("export", "--from", "{tmp}", "--to", "{tmp}/m.safetensors"),
    "generate": ("generate", "--prompt", "once upon a time"),
}

FILE, DIR = "file", "folder"
LOCKED = 0o000  # neither readable nor enterable
READ_ONLY = 0o555
READ_ONLY_FILE = 0o444


@dataclass(frozen=True)
class Fault:
    """What is wrong with the path: its value, the entries to create first (path: (kind,
    mode)), the phrase the sentence must hold, and whether permission bits make it."""

    name: str
    value: str
    setup: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    phrase: str = ""
    needs_permissions: bool = False


def read_faults(kind: str) -> list[Fault]:
    """The faults of a path to read, of ``kind`` FILE, DIR or both (None)."""
    item = kind or FILE
    faults = [Fault("missing", "{tmp}/missing", phrase="does not exist"),
              Fault("below-a-file", "{tmp}/file/inside", {"file": (FILE, None)}, "does not exist"),
              Fault("special-file", os.devnull, phrase="is neither a file nor a folder"),
              Fault("unreadable", "{tmp}/secret", {"secret": (item, LOCKED)}, "is not readable by this user", True),
              Fault("unreachable", "{tmp}/locked/item", {"locked/item": (item, None), "locked": (DIR, LOCKED)},
                    "cannot be reached by this user", True)]
    if kind == FILE:
        faults.append(Fault("a-folder", "{tmp}/folder", {"folder": (DIR, None)}, "is a folder, not a file"))
    if kind == DIR:
        faults.append(Fault("a-file", "{tmp}/file", {"file": (FILE, None)}, "is a file, not a folder"))
    if kind is None:  # a corpus folder: an unreadable folder, and unreadable files or subfolders in one
        faults += [Fault("unreadable-folder", "{tmp}/texts", {"texts/a.txt": (FILE, None), "texts": (DIR, LOCKED)},
                         "is not readable by this user", True),
                   Fault("unreadable-file-inside", "{tmp}/texts", {"texts/a.txt": (FILE, LOCKED)},
                         "texts/a.txt is not readable by this user", True),
                   Fault("unreadable-subfolder", "{tmp}/texts",
                         {"texts/a.txt": (FILE, None), "texts/sub/b.txt": (FILE, None), "texts/sub": (DIR, LOCKED)},
                         "texts/sub is not readable by this user", True)]
    return faults


def write_faults(kind: str, suffix: str = "") -> list[Fault]:
    """The faults of a path to write, a folder (DIR) or a file (FILE) named with ``suffix``."""
    name = f"new{suffix}"
    faults = [Fault("below-a-file", f"{{tmp}}/file/{name}", {"file": (FILE, None)},
                    "file is a file, not a folder; give a path whose parents are folders"),
              Fault("parent-not-writable", f"{{tmp}}/locked/{name}", {"locked": (DIR, READ_ONLY)},
                    "locked is not writable by this user", True),
              # /proc takes no new files and /sys refuses them; either may also deny this user outright
              Fault("in-proc", f"/proc/scaletrain-path-faults{suffix}", phrase="; choose a folder"),
              Fault("in-sys", f"/sys/scaletrain-path-faults{suffix}", phrase="; choose a folder")]
    if kind == DIR:
        faults += [Fault("a-file", "{tmp}/file", {"file": (FILE, None)}, "is a file, not a folder; give a folder"),
                   Fault("not-writable", "{tmp}/locked", {"locked": (DIR, READ_ONLY)},
                         "locked is not writable by this user", True)]
    else:
        faults += [Fault("a-folder", f"{{tmp}}/folder{suffix}", {f"folder{suffix}": (DIR, None)},
                         "is a folder; give a file path"),
                   Fault("not-writable", f"{{tmp}}/{name}", {name: (FILE, READ_ONLY_FILE)},
                         "is not writable by this user", True)]
    return faults


@dataclass(frozen=True)
class Row:
    command: str
    flag: str
    fault: Fault
    extra: tuple[str, ...] = ()  # flags the fault needs besides the path

    @property
    def id(self) -> str:
        return f"{self.command} {' '.join(self.extra)} {self.flag} {self.fault.name}".replace("  ", " ")

    def argv(self, tmp: Path, corpus: Path) -> list[str]:
        command = COMMANDS[self.command]
        if self.flag == "--data":  # a second --data would mix sources, not replace the first
            at = command.index("--data")
            command = command[:at] + command[at + 2:]
        given = (*command, *self.extra, self.flag, self.fault.value)
        return [arg.format(tmp=tmp, corpus=corpus) for arg in given]


def _rows(commands: tuple[str, ...], flag: str, faults: list[Fault], extra: tuple[str, ...] = ()) -> list[Row]:
    return [Row(command, flag, fault, extra) for command in commands for fault in faults]


# A run folder to resume whose configuration cannot be read: the sentence names --out, which gave it.
RUN_CONFIG_UNREADABLE = Fault("run-config-unreadable", "{tmp}/old", {"old/config.toml": (FILE, LOCKED)},
                              "old/config.toml is not readable by this user", True)
TRAINING = ("train", "finetune", "parity", "bench")
ROWS = [
    *_rows(TRAINING, "--config", read_faults(FILE)),
    *_rows(("train", "parity", "bench"), "--data", read_faults(None)),
    *_rows(("train", "parity", "bench"), "--tokenizer-from", read_faults(DIR)),
    *_rows(("train", "parity", "bench"), "--cache-dir", write_faults(DIR)),
    *_rows(("train",), "--out", write_faults(DIR)),
    *_rows(("train", "finetune"), "--out", [*read_faults(DIR), RUN_CONFIG_UNREADABLE], extra=("--resume",)),
    *_rows(("train", "finetune", "parity", "export", "generate"), "--from", read_faults(DIR)),
    *_rows(("bench allreduce",), "--plot", write_faults(FILE, ".png")),
    *_rows(("schedule", "plan"), "--png", write_faults(FILE, ".png")),
    *_rows(("schedule",), "--measured", read_faults(DIR)),
    *_rows(("export",), "--to", [*write_faults(FILE, ".safetensors"),
                                 Fault("folder-missing", "{tmp}/missing/m.safetensors",
                                       phrase="missing does not exist; create it first")]),
]
IN_PROCESS = [row for row in ROWS if not row.fault.needs_permissions]
AS_USER = [row for row in ROWS if row.fault.needs_permissions]


def _create(root: Path, setup: dict[str, tuple[str, int | None]]) -> None:
    """The fault's entries, each file holding a line of text."""
    for name, (kind, _) in setup.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == DIR:
            path.mkdir(exist_ok=True)  # perhaps made already as the parent of an earlier entry
        else:
            path.write_text("a line of text for the corpus\n")


def _lock(root: Path, setup: dict[str, tuple[str, int | None]]) -> None:
    """The fault's modes, deepest entries first: a folder is locked after what it holds."""
    for name, (_, mode) in sorted(setup.items(), key=lambda item: -len(Path(item[0]).parts)):
        if mode is not None:
            (root / name).chmod(mode)


def _unlock(root: Path, setup: dict[str, tuple[str, int | None]]) -> None:
    """Modes that let the folder be listed and removed again."""
    for name, (kind, mode) in setup.items():
        if mode is not None:
            (root / name).chmod(0o700 if kind == DIR else 0o600)


def _listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def invoke(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's mistakes exit from inside the parser
        return exc.code


def _assert_refused(row: Row, code: int, stderr: str, before: list[str], after: list[str]) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("."), stderr
    assert lines[0].startswith(f"scaletrain {row.command.split()[0]}: {row.flag} "), stderr
    assert row.fault.phrase in lines[0], stderr
    assert after == before


@pytest.mark.parametrize("row", IN_PROCESS, ids=[row.id for row in IN_PROCESS])
def test_path_fault_is_refused(row, corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where the default runs/ folder would appear
    _create(tmp_path, row.fault.setup)
    before = _listing(tmp_path)
    code = invoke(row.argv(tmp_path, corpus))
    _assert_refused(row, code, capsys.readouterr().err, before, _listing(tmp_path))


# What the commands import before they check their paths: loaded while the child can still
# read the interpreter's files.
PRELOADED = ("re", "shutil", "scaletrain.commands.train", "scaletrain.commands.parity", "scaletrain.bench.adam",
             "scaletrain.bench.allreduce", "scaletrain.bench.dp", "scaletrain.bench.pp",
             "scaletrain.bench.techniques", "scaletrain.bench.tp", "scaletrain.bench.zero",
             "scaletrain.parallel.pipeline.timeline", "scaletrain.job.export", "scaletrain.commands.generate",
             "scaletrain.planner.report", "scaletrain.planner.predict", "scaletrain.planner.search")
CANNOT_DROP = 77  # the child's exit code when it may not become nobody


def run_rows(rows: list[dict]) -> list[tuple[int, str]]:
    """Each row's ``argv`` run in its folder ``cwd``: exit code and stderr."""
    results = []
    for row in rows:
        os.chdir(row["cwd"])
        stderr = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            results.append((invoke(row["argv"]), stderr.getvalue()))
    return results


def serve_rows_as_nobody() -> None:
    """The child: the rows from stdin, run as nobody, their results to stdout as JSON."""
    for name in PRELOADED:
        importlib.import_module(name)
    nobody = pwd.getpwnam("nobody")
    try:
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)
    except PermissionError:
        sys.exit(CANNOT_DROP)
    json.dump(run_rows(json.load(sys.stdin)), sys.stdout)


def _run_as_nobody(rows: list[dict], root: Path) -> list[tuple[int, str]]:
    repo = str(Path(__file__).resolve().parents[1])
    # A temporary folder nobody may write: the runner's TMPDIR may be root's alone (0755, as on
    # many CI machines), and the child settles on its temporary folder while it is still root.
    scratch = root / "tmp"
    scratch.mkdir(mode=0o1777)
    scratch.chmod(0o1777)  # past the umask
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (repo, os.environ.get("PYTHONPATH")))),
           "HOME": str(root), "TMPDIR": str(scratch)}
    child = subprocess.run([sys.executable, "-c", "from tests.test_path_faults import serve_rows_as_nobody; "
                                                  "serve_rows_as_nobody()"],
                           input=json.dumps(rows), capture_output=True, text=True, env=env, cwd=root, timeout=120)
    if child.returncode == CANNOT_DROP:
        pytest.skip("permission faults need another user, and this root may not become nobody")
    assert child.returncode == 0, child.stderr
    return [tuple(result) for result in json.loads(child.stdout)]


def _enterable_by(path: Path, user: pwd.struct_passwd) -> bool:
    """Whether ``user`` (with no groups but its own, as the child runs) may pass through
    ``path`` and every folder above it: the bits of owner, group or others, whichever apply."""
    for folder in (path, *path.parents):
        st = folder.stat()
        if st.st_uid == user.pw_uid:
            bit = stat.S_IXUSR
        elif st.st_gid == user.pw_gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


def _folder_nobody_reaches() -> Path:
    """A new folder of root's whose parents nobody may enter: under the temporary folder where
    it allows (TMPDIR may be root's alone, mode 0700, as in sandboxed builds), else the first
    shared temporary folder that does; the rows are skipped where none does."""
    nobody = pwd.getpwnam("nobody")
    places = (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm")
    candidates = dict.fromkeys(Path(place).resolve() for place in places)
    for place in candidates:
        if place.is_dir() and _enterable_by(place, nobody):
            return Path(tempfile.mkdtemp(prefix="scaletrain-path-faults-", dir=place))
    pytest.skip(f"permission faults run as nobody in a folder it can reach, and nobody cannot enter "
                f"{', '.join(map(str, candidates))} or a folder above them")


@pytest.fixture(scope="module")
def as_user_results(corpus, tmp_path_factory) -> dict[str, tuple[int, str, list[str], list[str]]]:
    """Every permission row's exit code, stderr and its folder's listing before and after.
    As root: in one child that becomes nobody, in a folder nobody may enter and write."""
    as_root = os.geteuid() == 0
    root = _folder_nobody_reaches() if as_root else tmp_path_factory.mktemp("users")
    cwd = os.getcwd()
    try:
        root.chmod(0o755)
        shutil.copy(corpus, root / "corpus.txt")
        (root / "corpus.txt").chmod(0o644)
        folders = [root / str(i) for i in range(len(AS_USER))]
        for row, folder in zip(AS_USER, folders):
            folder.mkdir(mode=0o777)
            folder.chmod(0o777)  # past the umask: nobody writes the default folders here
            _create(folder, row.fault.setup)
        before = [_listing(folder) for folder in folders]  # unlocked, so that every entry is listed
        for row, folder in zip(AS_USER, folders):
            _lock(folder, row.fault.setup)
        requests = [{"argv": row.argv(folder, root / "corpus.txt"), "cwd": str(folder)}
                    for row, folder in zip(AS_USER, folders)]
        results = _run_as_nobody(requests, root) if as_root else run_rows(requests)
        for row, folder in zip(AS_USER, folders):
            _unlock(folder, row.fault.setup)
        return {row.id: (*result, listed, _listing(folder))
                for row, result, listed, folder in zip(AS_USER, results, before, folders)}
    finally:
        os.chdir(cwd)
        if as_root:
            shutil.rmtree(root)


@pytest.mark.parametrize("row", AS_USER, ids=[row.id for row in AS_USER])
def test_permission_fault_is_refused(row, as_user_results):
    _assert_refused(row, *as_user_results[row.id])


@pytest.mark.skipif(os.geteuid() != 0, reason="a TMPDIR only root may enter matters to the rows run as nobody")
def test_permission_rows_pass_under_a_private_tmpdir(tmp_path):
    """A few permission rows in a fresh pytest whose TMPDIR is root's alone (mode 0700, as
    sandboxed builds and some CI runners set it): they pass, or skip with their reason."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    ids = ("train --config unreadable", "train --data unreachable", "train --out not-writable")
    tests = [f"{__file__}::test_permission_fault_is_refused[{row_id}]" for row_id in ids]
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests],
                           capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[1],
                           env={**os.environ, "TMPDIR": str(private)})
    assert child.returncode == 0, child.stdout + child.stderr
    assert f"{len(ids)} passed" in child.stdout or "SKIPPED" in child.stdout, child.stdout
