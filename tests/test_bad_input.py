"""Every user mistake: exit code 2, one sentence on stderr that says what to change, and
nothing left behind (no run folder, no cache, no file of any kind).

The table runs in this process through ``scaletrain.commands.cli.main``, since a fresh interpreter per
case would cost seconds of imports each; a few cases also run as real processes to show that
the user sees no traceback there either.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from scaletrain.commands.cli import main
from tests.conftest import run_cli

# gpt-tiny for three steps: a case that wrongly passed would train for a second, not minutes. No
# --out: a run folder would default to runs/ under the test's folder, where the check sees it.
TINY = ("--model", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--steps", "3", "--warmup-steps", "1",
        "--eval-batches", "1", "--sample-tokens", "0", "--no-progress")

# Files a case creates in its folder first: bytes make a file, None an empty folder, an int a
# folder with that mode, FINISHED a copy of a run that trained all of TINY's three steps.
READ_ONLY = 0o500
FINISHED = "finished"
PREPARED_CORRUPT = "prepared-corrupt"  # a scaletrain prepare folder with one byte of a shard changed
CONFIG = b'[model]\nname = "gpt-tiny"\n'
NOT_A_FOLDER = {"taken": b"a file"}
GPT2_CONFIG = b'{"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 64, "vocab_size": 300}'


def case(name, args, phrase, files=None, command="train", marks=()):
    """One wrong invocation: ``args`` after the valid tiny ones (the last of a repeated flag wins;
    ``{tmp}`` is the test's folder), the phrase its sentence must hold, the files it needs."""
    return pytest.param(command, args, phrase, files or {}, id=name, marks=marks)


CASES = [
    # layouts
    case("world-not-product", ["--nproc", "2", "--dp", "3"], "choose sizes whose product is 2"),
    case("sizes-not-dividing-world", ["--nproc", "4", "--tp", "3"], "choose sizes whose product divides 4"),
    case("sp-without-tp", ["--sp"], "needs --tp 2 or more, not --tp 1; add --tp or drop --sp"),
    case("cp-seq-len", ["--nproc", "2", "--cp", "2", "--seq-len", "30"], "choose a --seq-len divisible by 4"),
    case("ep-without-experts", ["--nproc", "2", "--ep", "2"], "add --moe-experts (a multiple of 2) or use --ep 1"),
    case("ep-not-dividing-experts", ["--nproc", "2", "--ep", "2", "--moe-experts", "3"],
         "choose --moe-experts divisible by 2"),
    case("mlp-with-tp", ["--model", "mlp", "--nproc", "2", "--tp", "2"], "this model has none; use --tp 1"),
    case("mesh-order", ["--nproc", "4", "--tp", "2", "--mesh-order", "dp,tp,pp"],
         "--mesh-order dp,tp,pp must name each of dp,ep,pp,cp,tp exactly once"),
    case("heads-by-tp", ["--n-heads", "3", "--d-model", "48", "--nproc", "2", "--tp", "2"],
         "choose a --tp that divides 3"),
    case("d-model-by-heads", ["--d-model", "50", "--n-heads", "4"],
         "--d-model 50 is not divisible by --n-heads 4; choose sizes where it is"),
    case("sp-seq-len", ["--nproc", "2", "--tp", "2", "--sp", "--seq-len", "31"],
         "choose a --seq-len divisible by 2"),
    case("tp-adafactor", ["--nproc", "2", "--tp", "2", "--optimizer", "adafactor"],
         "--tp 2 does not combine with --optimizer adafactor"),
    case("zero-compress", ["--nproc", "2", "--zero", "2", "--compress", "sign"],
         "--zero 2 does not combine with --compress"),
    case("zero-ring", ["--nproc", "2", "--zero", "3", "--allreduce", "ring"],
         "--zero 3 does not combine with --allreduce ring"),
    case("bf16-true-masters", ["--precision", "bf16-true", "--masters", "fp32"],
         "--precision bf16-true means --precision bf16 --param-dtype bf16 --masters none --reduce-dtype bf16, which "
         "--masters fp32 contradicts; drop --masters"),
    case("bf16-true-reduce-dtype", ["--precision", "bf16-true", "--reduce-dtype", "fp32"],
         "which --reduce-dtype fp32 contradicts; drop --reduce-dtype"),
    case("bf16-true-offload", ["--nproc", "2", "--zero", "3", "--precision", "bf16-true", "--offload", "optimizer"],
         "--offload optimizer moves the optimizer's own copy of the weights (the fp32 masters) and its state to the "
         "host, and --masters none keeps no copy"),
    case("shard-group-without-zero", ["--nproc", "4", "--shard-group", "2"],
         "needs --zero 1, 2 or 3; add --zero or drop --shard-group"),
    case("shard-group-not-dividing-dp", ["--nproc", "4", "--zero", "3", "--shard-group", "3"],
         "choose a --shard-group that divides 4"),
    case("shard-group-zero", ["--zero", "1", "--shard-group", "0"], "--shard-group must be at least 1, not 0"),
    case("quantize-weights-without-zero3", ["--nproc", "2", "--zero", "2", "--quantize-weights", "int8"],
         "use --zero 3 or drop --quantize-weights"),
    case("parity-shard-group-cp", ["--nproc", "4", "--cp", "2", "--zero", "1", "--shard-group", "3"],
         "--shard-group 3 must divide the 4 ranks ZeRO shards over (--dp 2 x --cp 2)", command="parity"),
    # local SGD
    case("sync-every-zero", ["--sync-every", "0"], "--sync-every must be at least 1, not 0"),
    case("sync-every-one-replica", ["--sync-every", "4"], "this layout has one (dp 1); start more processes"),
    case("sync-every-with-zero", ["--nproc", "2", "--sync-every", "2", "--zero", "1"],
         "which --zero 1 shards over the same ranks; drop one of the two"),
    case("sync-every-with-compress", ["--nproc", "2", "--sync-every", "2", "--compress", "powersgd"],
         "replaces with a parameter average every 2 steps; drop one of the two"),
    case("sync-every-with-tp", ["--nproc", "4", "--tp", "2", "--sync-every", "2"],
         "and under --tp no rank holds one; drop one of the two"),
    case("sync-every-checkpoint-every", ["--nproc", "2", "--sync-every", "2", "--checkpoint-every", "3"],
         "--checkpoint-every 3 must be a multiple of --sync-every 2, so that every checkpoint holds averaged "
         "replicas; choose 2 or 4"),
    case("sync-every-resumes-shared-optimizer", ["--resume", "--out", "{tmp}/old", "--steps", "6", "--nproc", "2", "--dp", "2",
                                                 "--micro-batch", "2", "--sync-every", "2"],  # the run's batch of 4
         "holds one optimizer state for every rank, but --sync-every 2 keeps one per rank; resume without "
         "--sync-every", {"old": FINISHED}),
    case("sync-every-stop-at", ["--nproc", "2", "--sync-every", "2", "--stop-at", "1"],
         "--stop-at 1 must be a multiple of --sync-every 2"),
    # the mpi4py backend
    case("mpi4py-with-nproc", ["--backend", "mpi4py", "--nproc", "2"],
         "--backend mpi4py takes its processes from mpirun; run mpirun -n 2 scaletrain train ... without --nproc"),
    case("mpi4py-with-tp", ["--backend", "mpi4py", "--tp", "2"],
         "and under --tp the ranks hold different ones; drop --tp or use --backend gloo"),
    case("mpi4py-with-zero", ["--backend", "mpi4py", "--zero", "1"],
         "and under --zero the ranks hold different ones; drop --zero or use --backend gloo"),
    case("mpi4py-with-local-sgd", ["--backend", "mpi4py", "--sync-every", "2"],
         "and under --sync-every the ranks hold different ones; drop --sync-every or use --backend gloo"),
    case("mpi4py-bf16-reduction", ["--backend", "mpi4py", "--precision", "bf16", "--param-dtype", "bf16",
                                   "--reduce-dtype", "bf16"], "numpy has no bfloat16; use --reduce-dtype fp32"),
    case("unknown-backend", ["--backend", "nvshmem"], "invalid choice: 'nvshmem' (choose from"),
    # pipelines
    case("unknown-schedule", ["--nproc", "2", "--pp", "2", "--pp-schedule", "pipedream"],
         "invalid choice: 'pipedream' (choose from"),
    case("more-pp-than-layers", ["--nproc", "4", "--pp", "4"], "choose --pp at most 2"),
    case("more-stages-than-layers", ["--nproc", "2", "--pp", "2", "--pp-schedule", "interleaved",
                                     "--virtual-stages", "2", "--microbatches", "2"],
         "cuts the model into 4 stages, but it has 2 layers; lower one of the two or raise --n-layers"),
    case("interleaved-too-few-microbatches", ["--nproc", "2", "--pp", "2", "--n-layers", "4",
                                              "--pp-schedule", "interleaved", "--microbatches", "1"],
         "choose --microbatches divisible by 2, not 1"),
    case("virtual-stages-without-interleaved", ["--nproc", "2", "--pp", "2", "--n-layers", "4",
                                                "--virtual-stages", "2"], "needs --pp-schedule interleaved"),
    case("microbatches-without-pp", ["--microbatches", "4"], "add --pp, or use --grad-accum"),
    case("2bw-too-few-microbatches", ["--nproc", "2", "--pp", "2", "--pp-schedule", "pipedream-2bw",
                                      "--microbatches", "1"], "choose --microbatches 2 or more, not 1"),
    case("2bw-grad-accum", ["--nproc", "2", "--pp", "2", "--pp-schedule", "pipedream-2bw", "--grad-accum", "2"],
         "does not combine with --grad-accum: a weight version's gradient is that of its --microbatches"),
    case("2bw-zero", ["--nproc", "4", "--pp", "2", "--pp-schedule", "pipedream-2bw", "--zero", "1"],
         "--pp-schedule pipedream-2bw does not combine with --zero"),
    case("2bw-fp16", ["--pp-schedule", "pipedream-2bw", "--precision", "fp16"],
         "does not combine with --precision fp16"),
    case("2bw-checkpoint-every", ["--nproc", "2", "--pp", "2", "--pp-schedule", "pipedream-2bw",
                                  "--checkpoint-every", "1"], "so the run saves only at its end"),
    # data
    case("missing-data", ["--data", "/no/such/corpus"], "/no/such/corpus does not exist; give a UTF-8 text file"),
    case("empty-data-file", ["--data", "{tmp}/empty.txt"], "is empty; give a file that holds text",
         {"empty.txt": b""}),
    case("empty-data-folder", ["--data", "{tmp}/texts"],
         "holds no non-empty UTF-8 text files; put text files in it", {"texts": None}),
    case("binary-data-file", ["--data", "{tmp}/blob.bin"], "is not UTF-8 text; give a UTF-8 text file",
         {"blob.bin": bytes(range(256)) * 4}),
    case("corpus-shorter-than-a-sequence", ["--data", "{tmp}/short.txt"], "give more text or a smaller --seq-len",
         {"short.txt": b"too short"}),
    # 120 bytes, enough for a sequence of bytes but not of BPE tokens
    case("corpus-shorter-in-bpe-tokens", ["--data", "{tmp}/ab.txt", "--tokenizer", "bpe", "--vocab-size", "300"],
         "give more text or a smaller --seq-len", {"ab.txt": b"ab" * 60}),
    case("bpe-vocab-below-bytes", ["--tokenizer", "bpe", "--vocab-size", "100"],
         "--vocab-size 100 is below 257, the byte alphabet that BPE starts from and its end-of-text token; use 257 or more"),
    case("mlp-with-data", ["--model", "mlp"], "so drop --data"),
    case("tokenizer-from-missing", ["--tokenizer-from", "{tmp}/nowhere"],
         "does not exist; give a run folder or a Hugging Face model folder"),
    case("tokenizer-from-not-a-model", ["--tokenizer-from", "{tmp}/notes"],
         "is neither a run folder (it has no config.toml) nor a Hugging Face model folder",
         {"notes/a.txt": b"some text"}),
    case("n-vocab-below-tokenizer", ["--n-vocab", "100"], "--n-vocab 100 is below the 257 tokens of the tokenizer"),
    # run folder and cache
    case("out-is-a-file", ["--out", "{tmp}/taken"], "is a file, not a folder; give a folder path", NOT_A_FOLDER),
    case("out-inside-a-file", ["--out", "{tmp}/taken/run"], "taken is a file, not a folder; give a path whose "
         "parents are folders", NOT_A_FOLDER),
    case("out-read-only", ["--out", "{tmp}/locked/run"], "is not writable by this user; change its permissions "
         "or choose a folder you can write to",
         {"locked": READ_ONLY},
         marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")),
    case("cache-inside-a-file", ["--cache-dir", "{tmp}/taken/cache"], "taken is a file, not a folder",
         NOT_A_FOLDER),
    case("out-holds-another-run", ["--out", "{tmp}/old"],
         "already holds another run; choose a new folder or add --resume", {"old/config.toml": CONFIG}),
    case("resume-without-out", ["--resume"], "--resume needs --out"),
    case("resume-nothing", ["--resume", "--out", "{tmp}/run"],
         "does not exist; give the folder of the run to continue"),
    case("resume-folder-without-run", ["--resume", "--out", "{tmp}/other"], "holds no scaletrain run",
         {"other/notes.txt": b"someone else's files"}),
    case("resume-without-checkpoint", ["--resume", "--out", "{tmp}/old"],
         "found no complete checkpoint in", {"old/config.toml": CONFIG, "old/checkpoints/step_000001": None}),
    case("resume-finished-run", ["--resume", "--out", "{tmp}/old"],
         "already finished 3 of --steps 3; raise --steps", {"old": FINISHED}),
    case("resume-stop-at-before-checkpoint", ["--resume", "--out", "{tmp}/old", "--steps", "9", "--stop-at", "2"],
         "--stop-at 2 is not after step 3", {"old": FINISHED}),
    # models and sizes
    case("unknown-model", ["--model", "gpt-5"], "invalid choice: 'gpt-5' (choose from"),
    case("zero-steps", ["--steps", "0"], "--steps must be at least 1, not 0"),
    case("zero-micro-batch", ["--micro-batch", "0"], "--micro-batch must be at least 1"),
    case("negative-seq-len", ["--seq-len", "-8"], "--seq-len must be at least 1"),
    case("zero-grad-accum", ["--grad-accum", "0"], "--grad-accum must be at least 1"),
    case("zero-layers", ["--n-layers", "0"], "--n-layers must be at least 1"),
    case("zero-lr", ["--lr", "0"], "--lr must be positive"),
    case("negative-timeout", ["--timeout", "-5"], "--timeout must be positive"),
    case("zero-bucket", ["--bucket-mb", "0"], "--bucket-mb must be positive"),
    case("zero-powersgd-rank", ["--powersgd-rank", "0"], "--powersgd-rank must be at least 1"),
    case("negative-keep-last", ["--keep-last", "-1"], "--keep-last must not be negative"),
    case("dropout-above-one", ["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    case("val-fraction-one", ["--val-fraction", "1"], "--val-fraction must be between 0 and 1"),
    case("stop-at-after-steps", ["--stop-at", "9"], "--stop-at must lie between 1 and --steps (3)"),
    case("zero-norm-eps", ["--norm-eps", "0"], "--norm-eps must be positive"),
    case("n-positions-below-seq-len", ["--n-positions", "16"], "choose a --seq-len of at most 16"),
    case("kv-heads-with-tp", ["--model", "llama-tiny", "--nproc", "4", "--tp", "4"],
         "but the model has 2 key/value heads; choose a --tp that divides 2"),
    case("kv-heads-not-dividing", ["--model", "llama-tiny", "--n-kv-heads", "3"],
         "--n-heads 4 is not a multiple of --n-kv-heads 3"),
    case("rope-scaling-form", ["--model", "llama-tiny", "--rope-scaling", "8,1"], "is not FACTOR,LOW,HIGH,ORIGINAL"),
    case("kv-heads-on-gpt", ["--n-kv-heads", "2"], "--n-kv-heads applies to"),
    case("top-k-above-experts", ["--moe-experts", "2", "--moe-top-k", "3"], "choose at most 2"),
    case("recompute-policy", ["--recompute", "every:0"], "'every:0' is not valid; use one of"),
    case("compress-activations-unknown", ["--compress-activations", "int4"], "invalid choice: 'int4' (choose from"),
    case("compress-activations-toml", ["--config", "{tmp}/run.toml"], "config key 'compress_activations' must be one "
         "of none, bf16, int8, not 'fp8'", {"run.toml": b'compress_activations = "fp8"\n'}),
    case("debug-dist-toml", ["--config", "{tmp}/run.toml"], "config key 'debug_dist' must be bool, not 'yes'",
         {"run.toml": b'[parallel]\ndebug_dist = "yes"\n'}),
    case("not-a-number", ["--steps", "ten"], "invalid int value: 'ten'"),
    # options that contradict each other
    case("on-nan-stop-fp16", ["--on-nan", "stop", "--precision", "fp16"],
         "use --on-nan skip or another precision"),
    case("max-restarts-without-nproc", ["--max-restarts", "2"], "add --nproc"),
    case("param-dtype-without-bf16", ["--param-dtype", "bf16"], "--param-dtype bf16 needs --precision bf16"),
    case("reduce-dtype-without-bf16", ["--reduce-dtype", "bf16"], "add it, or keep --reduce-dtype fp32"),
    case("mlp-compile", ["--model", "mlp", "--compile"], "drop it for the mlp"),
    case("compile-mode-without-compile", ["--compile-mode", "reduce-overhead"], "add --compile"),
    case("cuda-graphs-under-zero3", ["--compile", "--compile-mode", "reduce-overhead", "--nproc", "2", "--zero", "3"],
         "gathers each block's weights into fresh storage every step"),
    case("cuda-graphs-under-pp", ["--compile", "--compile-mode", "reduce-overhead", "--nproc", "2", "--pp", "2"],
         "keeps several micro-batches in flight through a block"),
    case("unknown-allreduce", ["--allreduce", "tree"], "invalid choice: 'tree' (choose from"),
    case("unknown-zero-stage", ["--zero", "4"], "invalid choice: 4 (choose from"),
    case("unknown-flag", ["--not-a-flag"], "unrecognized arguments: --not-a-flag; see scaletrain --help"),
    # fine-tuning: the base, and a Hugging Face GPT-2 folder's files, are checked before anything is written
    case("finetune-from-missing", ["--from", "{tmp}/nowhere"],
         "does not exist; give a run folder, one of its checkpoints/step_NNNNNN folders or a Hugging Face model",
         command="finetune"),
    case("finetune-from-neither", ["--from", "{tmp}/notes"],
         "is neither a Hugging Face model folder (with a config.json) nor a run folder with a complete checkpoint",
         {"notes/a.txt": b"some text"}, command="finetune"),
    case("finetune-hf-without-tokenizer", ["--from", "{tmp}/gpt2"],
         "holds no tokenizer (tokenizer.json, or vocab.json with merges.txt)", {"gpt2/config.json": GPT2_CONFIG},
         command="finetune"),
    case("finetune-hf-without-weights", ["--from", "{tmp}/gpt2"], "holds no model.safetensors",
         {"gpt2/config.json": GPT2_CONFIG, "gpt2/vocab.json": b'{"a": 0, "b": 1}', "gpt2/merges.txt": b""},
         command="finetune"),
    # adapters adapt a base: without --from they would train every weight of a fresh model
    case("lora-without-base", ["--lora-rank", "4"], "--lora-rank adapts a base model, and there is none without "
         "--from: add --from BASE (a run folder or a Hugging Face model folder), or drop --lora-rank."),
    case("qlora-without-base", ["--lora-rank", "4", "--quantize", "nf4", "--lora-targets", "qkv"],
         "--lora-rank, --lora-targets and --quantize adapt a base model"),
    case("lora-alpha-without-base", ["--lora-alpha", "8"], "or drop --lora-alpha."),
    case("parity-lora-without-base", ["--nproc", "2", "--lora-rank", "4", "--zero", "3"],
         "--lora-rank adapts a base model", command="parity"),
    # TOML
    case("config-missing", ["--config", "{tmp}/nowhere.toml"], "does not exist; give the path of a TOML file"),
    case("config-syntax", ["--config", "{tmp}/run.toml"], "is not valid TOML", {"run.toml": b"steps = = 3\n"}),
    case("config-unknown-key", ["--config", "{tmp}/run.toml"], "unknown key 'stepz'",
         {"run.toml": b"stepz = 3\n"}),
    case("config-wrong-section", ["--config", "{tmp}/run.toml"], "unknown key 'steps' in section [model]",
         {"run.toml": b"[model]\nsteps = 3\n"}),
    case("config-wrong-type", ["--config", "{tmp}/run.toml"], "config key 'lr' must be float, not 'fast'",
         {"run.toml": b'[train]\nlr = "fast"\n'}),
    case("config-unknown-choice", ["--config", "{tmp}/run.toml"], "config key 'pp_schedule' must be one of",
         {"run.toml": b'pp_schedule = "pipedream"\n'}),
    case("config-bad-value", ["--config", "{tmp}/run.toml"], "--grad-accum must be at least 1",
         {"run.toml": b"grad_accum = 0\n"}),
    # parity takes train's flags and refuses the same mistakes, plus its own
    case("parity-world", ["--nproc", "2", "--dp", "3"], "choose sizes whose product is 2", command="parity"),
    case("parity-sp-without-tp", ["--nproc", "2", "--sp"], "add --tp or drop --sp", command="parity"),
    case("parity-tolerance", ["--nproc", "2", "--tolerance", "0"], "--tolerance must be positive",
         command="parity"),
    case("parity-empty-data", ["--nproc", "2", "--data", "{tmp}/empty.txt"], "is empty", {"empty.txt": b""},
         command="parity"),
    # records, instruction data and prepared folders (docs/data.md)
    case("records-without-the-field", ["--data", "{tmp}/d.jsonl"], "no field 'text'",
         {"d.jsonl": b'{"text": "fine"}\n{"content": "no text field"}\n'}),
    case("records-empty-file", ["--data", "{tmp}/d.jsonl"], "is empty", {"d.jsonl": b"\n"}),
    case("records-not-json", ["--data", "{tmp}/d.jsonl"], "is not JSON", {"d.jsonl": b'{"text": "a"}\nnot json\n'}),
    case("records-unknown-extension", ["--data", "{tmp}/d.jsonl", "--data", "{tmp}/d.xml:0.5"], "d.xml",
         {"d.jsonl": b'{"text": "a"}\n', "d.xml": b"<a/>"}),
    case("records-weight", ["--data", "{tmp}/d.jsonl:lots"], "is not a number", {"d.jsonl": b'{"text": "a"}\n'}),
    case("sft-without-an-answer", ["--sft", "--data", "{tmp}/d.jsonl"], "not an assistant answer",
         {"d.jsonl": b'{"messages": [{"role": "user", "content": "hi"}]}\n'}),
    case("sft-without-output", ["--sft", "--data", "{tmp}/d.jsonl"], "no output",
         {"d.jsonl": b'{"instruction": "say hi"}\n'}),
    case("sft-too-long", ["--sft", "--too-long", "refuse", "--data", "{tmp}/d.jsonl"], "longer than --seq-len 32",
         {"d.jsonl": b'{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": "' + b"long " * 20
          + b'"}\n'}),
    case("sft-on-plain-text", ["--sft"], "plain text"),
    case("prepared-corrupt", ["--data", "{tmp}/prepared"], "corrupt", {"prepared": PREPARED_CORRUPT}),
    case("prepare-bad-record", ["--data", "{tmp}/d.jsonl", "--out", "{tmp}/prepared"], "no field 'text'",
         {"d.jsonl": b'{"text": "a"}\n{"body": "b"}\n'}, command="prepare"),
    case("prepare-out-taken", ["--data", "{tmp}/d.jsonl", "--out", "{tmp}/taken"], "taken",
         {"d.jsonl": b'{"text": "a"}\n', "taken/notes.txt": b"mine"}, command="prepare"),
]


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", *TINY, "--data", str(corpus), "--out", str(out),
                 "--cache-dir", str(out.parent / "cache")]) == 0
    return out


@pytest.fixture(scope="module")
def prepared_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("prepared")
    (folder / "d.jsonl").write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(50)))
    assert main(["prepare", "--data", str(folder / "d.jsonl"), "--out", str(folder / "out"), "--no-progress"]) == 0
    return folder / "out"


def _create(root: Path, files: dict, request) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == FINISHED:  # trained only when a case needs it
            shutil.copytree(request.getfixturevalue("finished_run"), path)
        elif content == PREPARED_CORRUPT:
            shutil.copytree(request.getfixturevalue("prepared_folder"), path)
            shard = path / "shard-00000.bin"
            data = bytearray(shard.read_bytes())
            data[0] ^= 1
            shard.write_bytes(bytes(data))
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.mkdir()
            if content is not None:
                path.chmod(content)


def _listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def _argv(command: str, args: list[str], corpus: Path, tmp_path: Path) -> list[str]:
    """The valid tiny run, then the case's flags; --data, which repeats to mix sources, only once."""
    if command == "prepare":
        return [command, "--no-progress", *(arg.format(tmp=tmp_path) for arg in args)]
    valid = [*TINY, *([] if "--data" in args else ["--data", str(corpus)]), "--cache-dir", str(tmp_path / "cache")]
    return [command, *valid, *(arg.format(tmp=tmp_path) for arg in args)]


def _assert_one_sentence(code: int, stderr: str, phrase: str) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("."), stderr
    assert phrase in lines[0]


@pytest.mark.parametrize("command, args, phrase, files", CASES)
def test_mistake_is_one_sentence_and_leaves_nothing(command, args, phrase, files, corpus, tmp_path, monkeypatch,
                                                    capsys, request):
    monkeypatch.chdir(tmp_path)
    _create(tmp_path, files, request)
    before = _listing(tmp_path)
    try:
        code = main(_argv(command, args, corpus, tmp_path))
    except SystemExit as exc:  # argparse's mistakes exit from inside the parser
        code = exc.code
    _assert_one_sentence(code, capsys.readouterr().err, phrase)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("args, phrase", [
    (["--not-a-flag"], "unrecognized arguments: --not-a-flag"),
    (["--nproc", "2", "--dp", "3"], "choose sizes whose product is 2"),
    (["--data", "{tmp}/empty.txt"], "is empty"),
], ids=["argparse", "layout", "data"])
def test_a_real_process_prints_no_traceback(args, phrase, corpus, tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    result = run_cli(*_argv("train", args, corpus, tmp_path), cwd=tmp_path)
    _assert_one_sentence(result.returncode, result.stderr, phrase)
    assert _listing(tmp_path) == ["empty.txt"]
