"""Every command of the README, run as a user runs it, at tiny size.

Each command of the README's shell blocks is run here (or, where it needs a service a module
starts or a module checks it more closely, there: Ray's in tests/test_ray.py, mpirun's in
tests/test_mpi.py, the examples' in tests/test_examples.py, the races' in tests/test_bench.py,
tests/test_bench_throughput.py and tests/test_bench_planner.py),
in a folder of its own that is also its HOME, with what it reads made first (`MAKERS`: corpora,
a Hugging Face folder, an earlier run). It keeps every default a user
gets (the end-of-run sample, the evaluation, the progress bar); `Example.extra` only makes it
tiny, appended after the README's own flags so that it wins: a few steps, the gpt-tiny preset for
the default model (the README's first command keeps gpt-small). It passes when it exits 0 and
prints and writes what it promises.

`test_every_readme_command_is_run_by_a_test` fails when the README gains a command that no test
runs, and `readme_argv` fails a test whose command the README no longer holds. The docs' shell
blocks are checked more cheaply: each ``scaletrain`` command there parses with today's flags, and
those that only compute (the planner, a planned schedule, a predicted ladder) run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from scaletrain.commands.cli import build_parser, main
from tests.readme import README, ROOT, commands
from tests.test_llama_hf import PROSE, make_folder

TINY = "--model gpt-tiny --steps 2"
# Smaller batches, evaluation and sample than a user's defaults, all three still on.
SMALL = "--micro-batch 4 --eval-batches 2 --sample-tokens 24"
# Records a user's corpus might hold: enough text for the default 16 x 128-token batches.
LINES = [f"The fox number {i} jumps over the lazy dog {i % 7} times, and the dog sleeps.\n" for i in range(2000)]


# -- what the commands read, made as a user would have it ---------------------------------------


def _text(ws: Path) -> None:
    (ws / "prose.txt").write_text(PROSE)


def _books(ws: Path) -> None:
    (ws / "books").mkdir()
    for i in range(2):
        (ws / "books" / f"book{i}.txt").write_text("".join(LINES[i::2]))


def _jsonl(ws: Path) -> None:
    records = (json.dumps({"id": i, "body": line}) + "\n" for i, line in enumerate(LINES))
    (ws / "corpus.jsonl").write_text("".join(records))


def _parquet(ws: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    code = [f"def function_{i}(x):\n    return x * {i}\n" for i in range(1500)]
    pq.write_table(pa.table({"text": code}), ws / "code.parquet")


def _alpaca(ws: Path) -> None:
    records = [{"instruction": f"Name fox number {i}.", "input": "", "output": f"Fox {i} is called Rusty {i % 9}."}
               for i in range(300)]
    (ws / "alpaca.json").write_text(json.dumps(records))


def _tasks(ws: Path) -> None:
    """A multiple-choice task of the harness's YAML over a local JSONL file (docs/evaluation.md)."""
    (ws / "tasks").mkdir()
    rows = [{"question": f"The fox number {i} jumps over the lazy dog", "choices": [f" {i % 7} times", " never"],
             "label": 0} for i in range(8)]
    (ws / "tasks" / "my_mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (ws / "tasks" / "my_mc.yaml").write_text(
        f"task: my_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {ws / 'tasks' / 'my_mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_target: label\n"
        "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n")


def _toml(ws: Path) -> None:
    (ws / "run.toml").write_text('[model]\nname = "gpt-tiny"\n\n[train]\nsteps = 2\nlr = 1e-3\n')


def _script(ws: Path) -> None:
    """A user's own script: an MLP on the library, its learning rate from the command line."""
    (ws / "my_train.py").write_text('''\
import argparse

import torch
import torch.nn.functional as F

import scaletrain

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-2)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
with scaletrain.setup(model, lr=args.lr, steps=3, warmup_steps=0) as engine:
    data = torch.randn(64, 8), torch.randint(0, 2, (64,))
    for index in engine.sampler(64, 4):
        x, y = data[0][index], data[1][index]
        engine.backward(F.cross_entropy(engine(x), y))
        record = engine.step()
        if engine.steps_done == 3:
            break
    if engine.is_main:
        print(f"done: step {record['step']}, lr {args.lr}")
''')


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> Path:
    """Tiny Hugging Face folders as save_pretrained writes them: a Llama and a GPT-2, each with its
    tokenizer, with positions enough for the default sequence length."""
    transformers = pytest.importorskip("transformers", reason="the folders are made by transformers (dev extra)")
    root = tmp_path_factory.mktemp("hf")
    make_folder(root / "llama", "llama", max_position_embeddings=256)
    gpt2 = root / "gpt2"
    shutil.copytree(root / "llama", gpt2, ignore=lambda _, names: [n for n in names if n != "tokenizer.json"])
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=256, vocab_size=305, bos_token_id=None, eos_token_id=None))
    model.save_pretrained(gpt2, safe_serialization=True)
    return root


def _folder(name: str, link: str) -> Callable[[Path, Path], None]:
    def make(ws: Path, hf: Path) -> None:
        (ws / link).parent.mkdir(parents=True, exist_ok=True)
        (ws / link).symlink_to(hf / name, target_is_directory=True)
    return make


# What a command's workspace must hold first, by name: files made here, or an earlier
# command's run, produced once per session by running that README command.
def _machine_profile(ws: Path) -> None:
    """This machine's profile where --layout auto finds it (the folder's own cache, as _prepare sets it):
    measured by the quick calibration, seconds where a user's first auto run takes about a minute
    (that first run: tests/test_layout_auto.py, slow)."""
    done = subprocess.run([sys.executable, "-m", "scaletrain", "plan", "--calibrate", "--quick", "--nproc", "2"],
                          capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": str(ws / ".cache")},
                          timeout=240)
    assert done.returncode == 0, done.stderr


MAKERS: dict[str, Callable[[Path], None]] = {
    "prose.txt": _text, "books": _books, "corpus.jsonl": _jsonl, "code.parquet": _parquet,
    "alpaca.json": _alpaca, "run.toml": _toml, "my_train.py": _script, "tasks": _tasks,
    "machine profile": _machine_profile,
}
FOLDERS = {"HF_DIR": _folder("llama", "models/chat-llama"), "gpt2": _folder("gpt2", "models/gpt2"),
           "TinyLlama": _folder("llama", "models/TinyLlama-1.1B")}
PLACEHOLDERS = {"HF_DIR": "~/models/chat-llama"}


@dataclass(frozen=True)
class Example:
    command: str  # as the README gives it
    extra: str = ""  # flags that make it tiny, appended so that they win
    needs: tuple[str, ...] = ()  # MAKERS, FOLDERS or RUNS it reads
    says: tuple[str, ...] = ()  # what its output holds
    writes: tuple[str, ...] = ()  # files it makes, relative to its folder (RUN/: the run folder it trained)
    trains: bool = False  # ends as a training run does: losses, evaluation, sample, checkpoint
    slow: bool = False  # eight ranks, or run more closely by default elsewhere: pytest -m slow tests/test_readme.py

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.command.removeprefix("scaletrain ").lower()).strip("-")[:60]


def _train(command: str, extra: str = TINY, **kw) -> Example:
    return Example(command, f"{extra} {SMALL}".strip(), trains=True, **kw)


# Runs that later commands read, each made by the README command that makes it (with --out).
RUNS = {
    "runs/a": ("scaletrain train --out runs/a --checkpoint-every 50 --stop-at 100",
               f"--model gpt-tiny --steps 6 --checkpoint-every 2 --stop-at 4 {SMALL}"),
    "runs/ft": ("scaletrain finetune --from ~/models/TinyLlama-1.1B --data prose.txt --nproc 4 --tp 2 --pp 2",
                f"--steps 2 --out runs/ft {SMALL}"),
    "runs/sft": ("scaletrain finetune --from HF_DIR --data alpaca.json --sft --lora-rank 16",
                 f"--steps 2 --seq-len 64 --out runs/sft {SMALL}"),
    "sft-adapter": ("scaletrain export --from runs/sft --to sft-adapter --format peft", ""),
    "a-hf": ("scaletrain export --from runs/a --to a-hf --format hf", ""),
    "prepared": ("scaletrain prepare --data corpus.jsonl --text-field body --out prepared/ --workers 8", "--workers 2"),
}

EXAMPLES = [
    Example("scaletrain train", "--steps 2", trains=True),  # the main job: every default but its length
    _train("scaletrain train --model gpt-tiny --steps 50", "--steps 2"),
    _train("scaletrain train --model llama-tiny --steps 50", "--steps 2"),
    Example("scaletrain parity --model llama-tiny --nproc 4 --dp 2 --tp 2 --sp", "--steps 2", says=("PASS",)),
    _train("scaletrain train --model llama-tiny --nproc 2 --ep 2 --moe-experts 4", "--steps 2"),
    Example("scaletrain plan --model llama3-8b --gpus 8", says=("best first",)),
    _train("scaletrain train --model llama-tiny --nproc 2 --layout auto", "--steps 2", needs=("machine profile",),
           says=("--layout auto: ",), writes=("RUN/plan.json",)),
    _train("scaletrain train --data ~/books/ --tokenizer bpe", needs=("books",), writes=("RUN/tokenizer.json",)),
    _train("scaletrain train --data corpus.jsonl --text-field body", needs=("corpus.jsonl",)),
    Example(*RUNS["prepared"], needs=("corpus.jsonl",), writes=("prepared/manifest.json",)),
    _train("scaletrain train --data prepared/:0.7 --data code.parquet:0.3", needs=("prepared", "code.parquet")),
    Example(*RUNS["runs/sft"], needs=("HF_DIR", "alpaca.json"), trains=True, writes=("runs/sft/adapters.safetensors",)),
    Example("scaletrain parity --data alpaca.json --sft --nproc 2 --cp 2 --model llama-tiny --seq-len 128", "--steps 2",
            needs=("alpaca.json",), says=("PASS",)),
    _train("scaletrain train --model mlp --steps 200", "--steps 2"),
    _train("scaletrain train --precision bf16 --recompute full --report-memory", says=("memory ledger",),
           writes=("RUN/memory.json",)),
    _train("scaletrain train --precision bf16 --param-dtype bf16 --offload optimizer --compile"),
    _train("scaletrain train --optimizer adamw8bit --report-memory", says=("memory ledger",)),
    _train("scaletrain train --optimizer sgd --momentum 0"),
    _train("scaletrain train --precision bf16 --param-dtype bf16 --reduce-dtype bf16 --masters none "
           "--stochastic-rounding"),
    Example("scaletrain bench finetune --nproc 2", "--model gpt-tiny --steps 2 --warmup 1 --rungs full,zero3",
            says=("zero3", "peak"), writes=("runs/bench-finetune.png",)),
    Example("scaletrain bench finetune --model llama2-7b --gpu-memory 80GB", says=("qlora",)),
    _train("scaletrain train --tracker tensorboard,mlflow", writes=("mlruns",)),
    _train("scaletrain train --nproc 4 --dp 4"),
    _train("scaletrain train --nproc 2 --compress powersgd --report-comm", says=("communication ledger",),
           writes=("RUN/comm.json",)),
    _train("scaletrain train --nproc 2 --sync-every 4 --report-comm", says=("communication ledger",)),
    _train("scaletrain train --nproc 4 --zero 3 --report-memory", writes=("RUN/memory.json",)),
    _train("scaletrain train --nproc 8 --zero 3 --shard-group 4 --report-comm", slow=True),
    _train("scaletrain train --nproc 4 --tp 2 --sp"),
    Example("scaletrain parity --nproc 4 --tp 4 --sp", "--steps 2", says=("PASS",)),
    _train("scaletrain train --nproc 4 --pp 4 --microbatches 16 --pp-schedule zb-h1 --n-layers 8",
           says=("pipeline: zb-h1",), writes=("RUN/pipeline.json",)),
    Example("scaletrain schedule --pp 4 --microbatches 8 --pp-schedule interleaved --png tl.png", says=("bubble",),
            writes=("tl.png",)),
    Example("scaletrain plan --layers 32 --hidden 4096 --heads 32 --seq 4096 --gpus 8 --param-dtype bf16",
            says=("best first",)),
    _train("scaletrain train --nproc 8 --dp 2 --pp 2 --tp 2 --sp --zero 1 --pp-schedule zb-h1", slow=True),
    Example("scaletrain parity --nproc 8 --dp 2 --pp 2 --tp 2 --zero 2", "--steps 2", says=("PASS",), slow=True),
    _train("scaletrain train --nproc 4 --cp 4 --seq-len 512"),
    _train("scaletrain train --moe-experts 8"),
    _train("scaletrain train --nproc 4 --ep 4 --moe-experts 8 --report-comm", says=("communication ledger",)),
    _train("scaletrain train --fused triton --precision bf16 --param-dtype bf16",
           f"{TINY} --seq-len 64"),
    Example("scaletrain bench adam", says=("ours/fused",)),
    Example("scaletrain bench allreduce --nproc 2", "--steps 2 --warmup 1", says=("bus",),
            writes=("runs/bench-allreduce.png",)),
    _train("scaletrain train --config run.toml --lr 3e-4", "", needs=("run.toml",), says=("lr = 0.0003",)),
    Example(*RUNS["runs/a"], says=("finished step 4", "checkpoint: runs/a/checkpoints/step_000004"),
            writes=("runs/a/checkpoints/step_000004",)),
    Example("scaletrain train --out runs/a --resume", needs=("runs/a",), trains=True,  # the run's own config.toml
           says=("resumed from checkpoint step_000004",)),
    _train("scaletrain train --nproc 4 --out runs/b --max-restarts 3 --keep-last 2",
           f"{TINY} --steps 3 --checkpoint-every 1", writes=("runs/b/checkpoints/step_000003",)),
    Example("scaletrain export --from runs/a --to model.safetensors", needs=("runs/a",), writes=("model.safetensors",)),
    _train("scaletrain finetune --from runs/a --data prose.txt --lora-rank 8 --quantize nf4", "--steps 2",
           needs=("runs/a", "prose.txt")),
    _train("scaletrain finetune --from ~/models/gpt2 --data prose.txt --lora-rank 8", "--steps 2",
           needs=("gpt2", "prose.txt")),
    Example(*RUNS["runs/ft"], needs=("TinyLlama", "prose.txt"), trains=True),
    Example("scaletrain export --from runs/ft --to tinyllama-ft --format hf", needs=("runs/ft",),
            writes=("tinyllama-ft/config.json", "tinyllama-ft/model.safetensors", "tinyllama-ft/tokenizer.json")),
    Example(*RUNS["sft-adapter"], needs=("runs/sft",),
            writes=("sft-adapter/adapter_config.json", "sft-adapter/adapter_model.safetensors")),
    Example("scaletrain finetune --from HF_DIR --adapter sft-adapter --data alpaca.json --sft",
            f"--steps 2 --seq-len 64 {SMALL}", needs=("HF_DIR", "sft-adapter", "alpaca.json"), trains=True),
    Example("scaletrain eval --from runs/sft --tasks my_mc --include tasks/", needs=("runs/sft", "tasks"),
            says=("my_mc", "acc")),
    Example("scaletrain eval --from runs/sft --tasks my_mc --include tasks/ --nproc 2", needs=("runs/sft", "tasks"),
            says=("my_mc", "acc")),
    _train("scaletrain train --data prose.txt --eval-tasks my_mc --eval-tasks-include tasks/ --eval-tasks-every 100",
           needs=("prose.txt", "tasks"), says=("my_mc",)),
    Example("scaletrain bench load --model tinyllama-1.1b --nproc 2 --tp 2", "--model llama-tiny",
            says=("ours / peer",)),
    Example('scaletrain generate --from runs/a --prompt "def "', "--tokens 20", needs=("runs/a",), says=("def ",)),
    Example(*RUNS["a-hf"], needs=("runs/a",), writes=("a-hf/generation_config.json", "a-hf/special_tokens_map.json")),
    # 16 s; the harness's hf backend reads our exports by default in tests/test_end_of_text.py
    Example("lm_eval --model hf --model_args pretrained=a-hf --tasks my_mc --include_path tasks/",
            needs=("a-hf", "tasks"), says=("my_mc",), slow=True),
    Example('scaletrain generate --from runs/sft --chat --prompt "Name a fox."', "--tokens 20", needs=("runs/sft",)),
    Example("scaletrain parity --nproc 2 --dp 2", "--steps 2", says=("PASS",)),
    _train("torchrun --nproc-per-node 8 -m scaletrain train --dp 8", slow=True),
    Example("scaletrain run --nproc 4 --max-restarts 2 my_train.py --lr 1e-3", needs=("my_train.py",),
            says=("done: step 3, lr 0.001",)),
]
BY_COMMAND = {example.command: example for example in EXAMPLES}
# Commands whose test lives beside a service or suite of its own, found there by their text.
ELSEWHERE = ("tests/test_ray.py", "tests/test_mpi.py", "tests/test_examples.py", "tests/test_bench.py",
             "tests/test_bench_throughput.py", "tests/test_bench_planner.py")


# -- running one -----------------------------------------------------------------------------------


def _argv(example: Example) -> list[str]:
    command = example.command
    for placeholder, path in PLACEHOLDERS.items():
        command = command.replace(placeholder, path)
    words = [os.path.expanduser(word) for word in shlex.split(command)] + shlex.split(example.extra)
    if words[0] == "torchrun":  # a port of its own: other tests' jobs may hold torchrun's default
        from scaletrain.runtime import free_port

        words[1:1] = ["--master-port", str(free_port())]
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    return words


def _run(argv: list[str], ws: Path, capfd) -> tuple[int, str, str]:
    """``argv`` in ``ws``: a ``scaletrain`` command in this process, anything else as a program."""
    if argv[0] == "scaletrain" and argv[1] != "run":
        code = main(argv[1:])
        captured = capfd.readouterr()
        return code, captured.out, captured.err
    if argv[0] == "scaletrain":
        argv = [sys.executable, "-m", "scaletrain", *argv[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ws, timeout=500)
    return done.returncode, done.stdout, done.stderr


def _workspace(path: Path, monkeypatch) -> Path:
    """A folder that is the command's working folder and its HOME (so ~/ is inside it)."""
    path.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(path)
    monkeypatch.setenv("HOME", str(path))
    return path


def _check(example: Example, ws: Path, code: int, out: str, err: str) -> None:
    assert code == 0, f"{example.command}: exit {code}\n{err[-3000:]}"
    for said in example.says:
        assert said in out, f"{example.command} did not print {said!r}:\n{out[-3000:]}"
    run = None
    if example.trains:
        assert "finished step" in out and "validation loss" in out, out[-3000:]
        if "--model mlp" not in example.command:
            assert "--- sample ---" in out, out[-3000:]  # the end-of-run text, on by default
        (checkpoint,) = re.findall(r"^checkpoint: (.+)$", out, re.M)
        run = ws / Path(checkpoint).parent.parent
        assert (run / "metrics.jsonl").is_file() and (run / "config.toml").is_file()
    for written in example.writes:
        path = run / written.removeprefix("RUN/") if written.startswith("RUN/") else ws / written
        assert path.exists(), f"{example.command} did not write {written}"


@pytest.fixture(scope="session")
def produced(tmp_path_factory, hf_folders):
    """Each of RUNS, made once by its README command, in a folder of its own."""
    made: dict[str, Path] = {}

    def produce(name: str, monkeypatch, capfd) -> Path:
        if name not in made:
            example = BY_COMMAND[RUNS[name][0]]
            ws = _workspace(tmp_path_factory.mktemp(name.replace("/", "-")), monkeypatch)
            _prepare(example, ws, produce, monkeypatch, capfd, hf_folders)
            _check(example, ws, *_run(_argv(example), ws, capfd))
            made[name] = ws
        return made[name]
    return produce


def _prepare(example: Example, ws: Path, produce, monkeypatch, capfd, hf: Path) -> None:
    for need in example.needs:
        if need in MAKERS:
            MAKERS[need](ws)
        elif need in FOLDERS:
            FOLDERS[need](ws, hf)
        else:  # an earlier command's output, copied so that this command may change it
            source = produce(need, monkeypatch, capfd) / need
            shutil.copytree(source, ws / need, symlinks=True)
    monkeypatch.chdir(ws)
    monkeypatch.setenv("HOME", str(ws))
    monkeypatch.setenv("XDG_CACHE_HOME", str(ws / ".cache"))  # its own, as its HOME: a machine profile there


@pytest.mark.parametrize("example", [pytest.param(e, id=e.id, marks=[pytest.mark.slow] if e.slow else [])
                                     for e in EXAMPLES])
def test_readme_command(example, produced, hf_folders, tmp_path, monkeypatch, capfd):
    if example.command in {command for command, _ in RUNS.values()}:
        name = next(name for name, (command, _) in RUNS.items() if command == example.command)
        produced(name, monkeypatch, capfd)  # made and checked once, for this test and its readers
        return
    ws = _workspace(tmp_path / "home", monkeypatch)
    _prepare(example, ws, produced, monkeypatch, capfd, hf_folders)
    _check(example, ws, *_run(_argv(example), ws, capfd))


# -- nothing left out --------------------------------------------------------------------------------


def _ci_commands() -> list[str]:
    return [" ".join(line.split()) for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_readme_command_is_run_by_a_test():
    # Those modules' source, with strings Python joins across lines ("a "\n    "b") joined.
    elsewhere = re.sub(r'"\s*\n\s*"', "", "\n".join((ROOT / path).read_text() for path in ELSEWHERE))
    ci = _ci_commands()
    runnable = []
    for command in commands():
        setup, _, then = command.rpartition(" && ")
        if setup:  # the README's two opening commands: CI installs exactly so, then runs the rest
            assert setup.replace("-e .", "-e '.[dev]'") in ci, f"CI does not install as the README says: {setup}"
        if "pytest" not in then.split():  # the test commands: test_the_readme_test_commands_are_what_ci_runs
            runnable.append(then)
    missing = [command for command in runnable if command not in BY_COMMAND
               and f'"{command}"' not in elsewhere and f"'{command}'" not in elsewhere]
    assert not missing, f"README commands no test runs (add them to EXAMPLES): {missing}"
    stale = sorted(set(BY_COMMAND) - set(runnable))
    assert not stale, f"EXAMPLES of commands the README no longer holds: {stale}"


def _readme_test_commands() -> list[str]:
    return [command.rpartition(" && ")[2] for command in commands() if "pytest" in command.split()]


def test_the_readme_test_commands_are_what_ci_runs():
    """CI runs the README's test command and its numerics rerun, as written."""
    ci = _ci_commands()
    tests = _readme_test_commands()
    assert tests[0] == "python3 -m pytest" and tests[0] in ci
    assert tests[1] in ci  # ATEN_CPU_CAPABILITY=default ... -m "numerics and not slow"
    assert len(tests) == 3  # and the kernel-sensitive part, below


@pytest.mark.slow  # 24 s: collecting most of the suite
def test_the_readmes_kernel_sensitive_command_collects_tests():
    """The README's command for the kernel-sensitive part collects tests (run whole, it is the suite itself)."""
    (subset,) = _readme_test_commands()[2:]
    done = subprocess.run(["bash", "-c", f"{subset} --collect-only -q"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert int(re.search(r"(\d+) tests? collected", done.stdout).group(1)) > 100


def _docs_commands() -> list[tuple[str, str]]:
    return [(path.name, command) for path in [README, *sorted((ROOT / "docs").glob("*.md"))]
            for command in commands(path) if command.startswith("scaletrain ")]


def _concrete(words: list[str], parser) -> list[str]:
    """A documented command with its placeholders filled: ``...`` and optional ``[...]`` brackets
    dropped, a shell variable standing for several flags (``$C``) left out, and a placeholder value
    (``$mode``, ``N``) replaced by one its flag takes."""
    (verbs,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    options = verbs.choices[words[1]]._option_string_actions
    filled = []
    for word in (w.strip("[]") for w in words if w != "..."):
        flag = options.get(filled[-1]) if filled else None
        takes_value = flag is not None and flag.nargs != 0
        if takes_value and (word.startswith("$") or re.fullmatch(r"[A-Z]", word)):
            word = str(flag.choices[0]) if flag.choices else "1" if flag.type in (int, float) else word
        elif word.startswith("$") and not takes_value:
            continue
        filled.append(word)
    return filled


@pytest.mark.parametrize("where, command", _docs_commands())
def test_every_documented_command_parses(where, command, capfd):
    """Each ``scaletrain`` command of the README and the docs names flags and values the command
    takes today (placeholders such as HF_DIR are values like any other)."""
    parser = build_parser()
    words = _concrete(shlex.split(command.split(" | ")[0].split(" > ")[0]), parser)
    try:
        parser.parse_args(words[1:])
    except SystemExit as exc:
        pytest.fail(f"{where}: {command!r} does not parse: {capfd.readouterr().err.strip()} (exit {exc.code})")


def _cheap(command: str) -> bool:
    """Documented commands that only compute (the planner, a planned schedule, a predicted ladder)."""
    return (command.startswith(("scaletrain plan ", "scaletrain schedule "))
            or command.startswith("scaletrain bench finetune ") and "--gpu-memory" in command) \
        and "--measured" not in command


@pytest.mark.parametrize("where, command", [(w, c) for w, c in _docs_commands() if _cheap(c) and w != "README.md"])
def test_the_docs_commands_that_only_compute_run(where, command, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)[1:]) == 0, f"{where}: {command}: {capfd.readouterr().err[-2000:]}"
