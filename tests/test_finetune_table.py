"""docs/finetuning.md's table from axolotl's and torchtune's config keys to our flags: every row's
flags parse with today's command line, and each sets the setting the row says it does (the
configuration differs from the one without it). What each setting does is tested where it lives."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from scaletrain.commands.cli import build_parser
from scaletrain.config import given_values

DOC = Path(__file__).resolve().parents[1] / "docs" / "finetuning.md"
BASE = ["finetune", "--from", "base", "--data", "data.jsonl"]


def _rows() -> list[tuple[str, str]]:
    """(axolotl key, our flags) of each row of the table."""
    text = DOC.read_text(encoding="utf-8").split("## From axolotl and torchtune")[1]
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`--"):
            rows.append((cells[0], re.match(r"`([^`]+)`", cells[2]).group(1)))
    return rows


def test_the_table_covers_the_keys_users_bring():
    keys = " ".join(key for key, _ in _rows())
    for key in ("base_model", "alpaca", "chat_template", "sequence_len", "sample_packing", "train_on_inputs",
                "num_epochs", "micro_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler",
                "warmup_steps", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                "lora_modules_to_save", "resume_from_checkpoint"):
        assert key in keys, key


@pytest.mark.parametrize("key, flags", _rows())
def test_each_rows_flags_set_what_the_row_names(key, flags):
    words = shlex.split(flags)
    parser = build_parser()
    without = given_values(parser.parse_args(BASE))
    given = given_values(parser.parse_args([*BASE, *words]))  # a repeated flag: the last one counts
    changed = {name for name in set(given) | set(without) if given.get(name) != without.get(name)}
    assert changed, f"{key}: {flags} sets nothing"
