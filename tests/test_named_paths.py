"""Every file of this project that a docstring, a comment or a doc names exists: a newcomer who
follows "(models/decoder.py)" or "docs/zero.md" finds it. A path counts as the project's when it
starts with one of the project's folders (``scaletrain``, ``docs``, ``tests``, ``scripts`` or a
folder of the package, such as ``parallel/``), and it may be written from the repository's root
or from the package's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scaletrain"
NAMED = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w.-]*/)+[\w.-]+\.(?:py|md|sh|toml))\b")


def _project_folders() -> set[str]:
    folders = {"scaletrain", "docs", "tests", "scripts"}
    folders |= {p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    return folders


def _readable_files() -> list[Path]:
    return [*PACKAGE.rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "scripts").iterdir(),
            *(ROOT / "tests").glob("*.py")]


def test_every_file_path_named_in_the_code_and_docs_exists():
    folders = _project_folders()
    missing = []
    for readable in _readable_files():
        for match in NAMED.finditer(readable.read_text(encoding="utf-8")):
            named = match.group(1)
            if named.split("/")[0] not in folders:
                continue  # another project's path, or a placeholder (RUN/config.toml)
            if not any((base / named).exists() for base in (ROOT, PACKAGE)):
                missing.append(f"{readable.relative_to(ROOT)} names {named}")
    assert not missing, "\n".join(missing)


def test_the_pattern_finds_paths_as_the_docs_write_them():
    text = "the step (train/stepper.py) and docs/zero.md; `scaletrain/parallel/pipeline/runtime.py`, not x.py"
    assert [m.group(1) for m in NAMED.finditer(text)] == ["train/stepper.py", "docs/zero.md",
                                                           "scaletrain/parallel/pipeline/runtime.py"]
