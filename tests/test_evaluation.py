"""``scaletrain eval`` against the harness's own ``hf`` backend, distributed evaluation, and
``--eval-tasks`` during training (docs/evaluation.md).

Two small runs are made here, as a user makes them: a fine-tune of a Llama folder whose
tokenizer has an end-of-text token, and a llama-tiny run from scratch with the byte tokenizer,
whose end-of-text token (id 256) ends every document and is the prefix token both backends
find in the export with no model arguments. Each is exported with ``scaletrain export --format hf``, and the harness's
``hf`` backend (transformers, fp32 on the CPU) scores the export on the same local tasks: a
multiple-choice task (with two-shot contexts longer than the model's window, so the left
truncation is compared too), a perplexity task whose texts span several windows
(``loglikelihood_rolling``) and a generation task. Every request's answer must match: the
log-likelihoods within 1e-5 relative, the greedy flags and the generated texts exactly. The
tasks' data are JSONL files written here; nothing needs a network.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.commands.cli import main
from scaletrain.train import checkpoint as ckpt

lm_eval = pytest.importorskip("lm_eval", reason="scaletrain eval needs the [eval] extra")
transformers = pytest.importorskip("transformers", reason="comparing with the hf backend needs the dev extra")
transformers.utils.logging.disable_progress_bar()

SEQ = 64
PROSE = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(400))
END = "<|endoftext|>"
BATCH = "4"
QUIET = ["--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--warmup-steps", "1"]


def _write_tasks(folder: Path) -> Path:
    """Three local tasks over JSONL files: toy_mc (multiple choice, two-shot), toy_ppl
    (perplexity, loglikelihood_rolling) and toy_gen (generate_until)."""
    folder.mkdir()
    lines = PROSE.splitlines(keepends=True)
    # The generation prompts stop at different places of a line (after "def", inside "return x",
    # ...), so that even a model trained a few steps writes different continuations.
    questions = [{"question": f"def function_{i}(x):\n    return x *",
                  "prefix": "".join(lines[2 * i:2 * i + 2])[:6 + 5 * (i % 10)],
                  "choices": [str(i), str(i + 1), str(3 * i + 2), "zero"], "label": i % 2}
                 for i in range(10, 22)]
    texts = [{"text": "".join(f"def function_{i + j}(x):\n    return x * {i + j} + {(i + j) % 7}\n" for j in range(4))}
             for i in range(0, 60, 10)]
    for name, rows in (("questions", questions), ("texts", texts)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (folder / "toy_mc.yaml").write_text(
        "task: toy_mc\n" + data.format(folder / "questions.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: label\ndoc_to_choice: choices\nnum_fewshot: 2\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / "toy_ppl.yaml").write_text(
        "task: toy_ppl\n" + data.format(folder / "texts.jsonl") + "output_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (folder / "toy_gen.yaml").write_text(
        "task: toy_gen\n" + data.format(folder / "questions.jsonl") + "output_type: generate_until\n"
        "doc_to_text: '{{prefix}}'\ndoc_to_target: ' {{choices[0]}}'\n"
        "generation_kwargs:\n  until: ['#', '\\n\\n']\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return folder


def _llama_folder(folder: Path) -> Path:
    """A random Llama folder whose byte-level BPE names <|endoftext|> its beginning and end of text."""
    from tokenizers import ByteLevelBPETokenizer

    folder.mkdir()
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([PROSE], vocab_size=300, min_frequency=2, show_progress=False, special_tokens=[END])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "bos_token": END, "eos_token": END}))
    end = tokenizer.token_to_id(END)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
                                      vocab_size=tokenizer.get_vocab_size(), bos_token_id=end, eos_token_id=end)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The tasks, and each run with its hf export: the fine-tune (``ft``) and the byte-level run (``bytes``)."""
    root = tmp_path_factory.mktemp("evaluation")
    prose = root / "prose.txt"
    prose.write_text(PROSE)
    common = ["--data", str(prose), "--seq-len", str(SEQ), "--micro-batch", "8", "--cache-dir", str(root / "cache"),
              *QUIET]
    assert main(["finetune", "--from", str(_llama_folder(root / "base")), "--steps", "12", "--lr", "3e-3",
                 "--out", str(root / "ft"), *common]) == 0
    assert main(["train", "--model", "llama-tiny", "--steps", "3", "--out", str(root / "bytes"), *common]) == 0
    for run in ("ft", "bytes"):
        assert main(["export", "--from", str(root / run), "--to", str(root / f"{run}_hf"), "--format", "hf"]) == 0
    return {"root": root, "tasks": _write_tasks(root / "tasks"), "ft": root / "ft", "bytes": root / "bytes"}


def ours(source: Path, tasks: Path, names: str, out: Path, *extra: str) -> dict:
    assert main(["eval", "--from", str(source), "--tasks", names, "--include", str(tasks), "--batch-size", BATCH,
                 "--log-samples", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def theirs(folder: Path, tasks: Path, names: str, *model_args: str, limit: int | None = None) -> dict:
    """The harness's hf backend on a Hugging Face folder, fp32 on the CPU."""
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="hf", model_args=",".join([f"pretrained={folder}", "dtype=float32", *model_args]),
        tasks=names.split(","), task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True, device="cpu", batch_size=int(BATCH), limit=limit)


@pytest.fixture(scope="module")
def compared(made, tmp_path_factory):
    """(ours, theirs) for each run on the three tasks, the hf backend given no model arguments but
    the folder (and fp32)."""
    out = tmp_path_factory.mktemp("results")
    return {run: (ours(made[run], made["tasks"], "toy_mc,toy_ppl,toy_gen", out / f"{run}.json"),
                  theirs(made["root"] / f"{run}_hf", made["tasks"], "toy_mc,toy_ppl,toy_gen"))
            for run in ("ft", "bytes")}


def by_document(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def assert_same_answers(ours_results: dict, their_results: dict, task: str) -> None:
    """Every request's answer, document by document: log-likelihoods within 1e-5 relative, greedy
    flags and generated texts exactly."""
    mine, hf = by_document(ours_results, task), by_document(their_results, task)
    assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in hf] and mine
    for a, b in zip(mine, hf, strict=True):
        assert a["arguments"] == json.loads(json.dumps(b["arguments"]))  # the same prompts reached both
        for x, y in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            if isinstance(y, str):
                assert x == y
            elif isinstance(y, (list, tuple)):  # (log-likelihood, greedy)
                assert relative(x[0], float(y[0])) < 1e-5 and bool(x[1]) == bool(y[1]), (x, y)
            else:
                assert relative(x, float(y)) < 1e-5, (x, y)


def assert_same_metrics(ours_results: dict, their_results: dict, task: str) -> None:
    for key, value in their_results["results"][task].items():
        if "," in key and isinstance(value, (int, float)) and "stderr" not in key:
            assert relative(ours_results["results"][task][key], float(value)) < 1e-5, key


@pytest.mark.parametrize("run, task", [("ft", "toy_mc"), ("ft", "toy_ppl"), ("ft", "toy_gen"),
                                       ("bytes", "toy_mc"), ("bytes", "toy_ppl"), ("bytes", "toy_gen")])
def test_every_request_is_answered_as_the_hf_backend_answers_the_export(compared, run, task):
    mine, hf = compared[run]
    assert_same_answers(mine, hf, task)
    assert_same_metrics(mine, hf, task)


def test_the_tasks_exercise_truncation_stops_and_several_windows(made, compared):
    """What the comparisons above cover: two-shot contexts past the model's window of SEQ tokens,
    texts of several windows, generations that a stop string cut and that differ from each other."""
    mine, _ = compared["bytes"]
    assert max(len(a["arguments"][0][0]) for a in mine["samples"]["toy_mc"]) > SEQ  # bytes: a token per character
    assert min(len(s["arguments"][0][0]) for s in mine["samples"]["toy_ppl"]) > 2 * SEQ
    generated = [s["filtered_resps"][0] for s in compared["ft"][0]["samples"]["toy_gen"]]
    assert len(set(generated)) > 1
    assert mine["config"]["prefix_token_id"] == 256 and compared["ft"][0]["config"]["max_length"] == SEQ


def test_two_processes_give_one_process_results(made, compared, tmp_path):
    single, _ = compared["ft"]
    split = ours(made["ft"], made["tasks"], "toy_mc,toy_ppl,toy_gen", tmp_path / "two.json", "--nproc", "2")
    assert split["config"]["processes"] == 2
    for task in ("toy_mc", "toy_ppl", "toy_gen"):
        assert_same_metrics(split, single, task)
        assert_same_answers(split, single, task)


SPLITS = [  # (source, flags, tensor-parallel size); the four-process layouts in the slow suite
    pytest.param("ft", ["--nproc", "2", "--tp", "2"], 2, id="tp2-run", marks=pytest.mark.slow),  # as the folder's
    pytest.param("ft_hf", ["--nproc", "2", "--tp", "2"], 2, id="tp2-hf-folder"),
    pytest.param("ft", ["--nproc", "2", "--pp", "2"], 1, id="pp2-run"),
    pytest.param("ft", ["--nproc", "4", "--tp", "2"], 2, id="dp2-tp2-run", marks=pytest.mark.slow),
    pytest.param("ft", ["--nproc", "4", "--tp", "2", "--pp", "2"], 2, id="tp2-pp2-run", marks=pytest.mark.slow),
]


@pytest.mark.numerics  # tp sums each product's slices in another order: log-likelihoods within 1e-5
@pytest.mark.parametrize("source, flags, tp", SPLITS)
def test_a_split_model_gives_one_process_results(made, compared, tmp_path, source, flags, tp):
    """--tp and --pp: each copy of the model split over processes, each reading only its slices of
    its stages (the run's checkpoint through the trainer's loader, the export's folder slice by
    slice), every forward one pipeline round whose logits every stage scores, as one process scores
    the run: every log-likelihood, greedy flag and generated text, and the whole model's size. Pipeline
    stages alone run one device's arithmetic (equal to the bit), held to tp's tolerance too."""
    single, _ = compared["ft"]
    split = ours(made["root"] / source, made["tasks"], "toy_mc,toy_ppl,toy_gen", tmp_path / "split.json", *flags)
    assert split["config"]["processes"] == int(flags[1]) and split["config"]["tensor_parallel"] == tp
    assert split["config"]["pipeline_parallel"] == (2 if "--pp" in flags else 1)
    assert split["config"]["model_num_parameters"] == single["config"]["model_num_parameters"]
    for task in ("toy_mc", "toy_ppl", "toy_gen"):
        assert_same_metrics(split, single, task)
        assert_same_answers(split, single, task)


def test_the_results_go_into_the_run_folder_and_the_table_is_printed(made, capsys):
    assert main(["eval", "--from", str(made["bytes"]), "--tasks", "toy_mc", "--include", str(made["tasks"]),
                 "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "|toy_mc" in out and "|acc" in out
    written = Path(out.strip().splitlines()[-1].removeprefix("results: "))
    assert written.parent == made["bytes"] / "eval" and written.name.startswith("step_000003-")
    results = json.loads(written.read_text())
    assert results["n-samples"]["toy_mc"]["effective"] == 3 and "samples" not in results


def test_a_qlora_fine_tune_is_scored_with_its_adapters_merged(made, tmp_path, capsys):
    """LoRA adapters over an NF4 base: scored as the export (adapters merged into the dequantized
    base) scores under the hf backend."""
    run = tmp_path / "qlora"
    assert main(["finetune", "--from", str(made["bytes"]), "--lora-rank", "4", "--quantize", "nf4", "--steps", "2",
                 "--lr", "1e-2", "--data", str(made["root"] / "prose.txt"), "--micro-batch", "4",
                 "--cache-dir", str(made["root"] / "cache"), *QUIET, "--out", str(run)]) == 0
    assert main(["export", "--from", str(run), "--to", str(tmp_path / "qlora_hf"), "--format", "hf"]) == 0
    mine = ours(run, made["tasks"], "toy_mc", tmp_path / "qlora.json", "--limit", "6")
    hf = theirs(tmp_path / "qlora_hf", made["tasks"], "toy_mc", "prefix_token_id=10", limit=6)
    assert_same_answers(mine, hf, "toy_mc")
    assert_same_metrics(mine, hf, "toy_mc")
    # Its adapters are merged into whole weights: split, it is refused, and its export offered instead.
    capsys.readouterr()  # the progress bars so far
    code = main(["eval", "--from", str(run), "--tasks", "toy_mc", "--include", str(made["tasks"]), "--nproc", "2",
                 "--tp", "2", "--out", str(tmp_path / "refused.json")])
    _one_sentence(code, capsys.readouterr().err, "is a LoRA fine-tune whose adapters are merged whole; scaletrain "
                                                 "export --format hf it")


def test_the_chat_template_is_rendered_as_transformers_renders_it(made):
    """A conversation in the built-in template (the one ``--sft`` trains in), with a question to
    answer and with an assistant's message to continue, as transformers' apply_chat_template."""
    from scaletrain.data.chat import BUILTIN_TEMPLATE
    from scaletrain.job.harness import ScaletrainLM
    from scaletrain.job.model_source import load_model

    lm = ScaletrainLM(*load_model(made["ft"]), device=torch.device("cpu"))
    hf = transformers.AutoTokenizer.from_pretrained(made["root"] / "ft_hf")
    hf.chat_template = BUILTIN_TEMPLATE
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "The answer is"}]
    for history, prompt in ((chat[:2], True), (chat, False)):
        assert lm.apply_chat_template(history, add_generation_prompt=prompt) == hf.apply_chat_template(
            history, tokenize=False, add_generation_prompt=prompt, continue_final_message=not prompt)


@pytest.mark.parametrize("layout", [[], ["--nproc", "2", "--dp", "2", "--zero", "3"]], ids=["one-process", "zero3"])
def test_eval_tasks_during_training_write_their_metrics_to_metrics_jsonl(made, tmp_path, layout, capsys):
    run = tmp_path / "run"
    assert main(["train", "--model", "llama-tiny", "--steps", "4", "--data", str(made["root"] / "prose.txt"),
                 "--seq-len", str(SEQ), "--micro-batch", "4", "--cache-dir", str(made["root"] / "cache"), *QUIET,
                 "--out", str(run), "--eval-tasks", "toy_mc", "--eval-tasks-include", str(made["tasks"]),
                 "--eval-tasks-every", "2", "--eval-tasks-limit", "4", *layout]) == 0
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert [step for step, r in records.items() if "eval/toy_mc/acc" in r] == [2, 4]
    assert {"eval/toy_mc/acc", "eval/toy_mc/acc_norm"} <= set(records[4])
    # The step's checkpoint was saved for the harness, and scaletrain eval on it gives the same numbers.
    assert [path.name for path in ckpt.complete_checkpoints(run)] == ["step_000002", "step_000004"]
    for step in (2, 4):  # (the tasks loaded before the first step serve every evaluation)
        again = ours(run / "checkpoints" / f"step_{step:06d}", made["tasks"], "toy_mc", tmp_path / f"{step}.json",
                     "--limit", "4", "--bootstrap-iters", "0")
        for metric in ("acc", "acc_norm"):
            assert records[step][f"eval/toy_mc/{metric}"] == again["results"]["toy_mc"][f"{metric},none"]


def test_evaluating_during_training_leaves_the_training_unchanged(made, tmp_path):
    """A run evaluated after every step trains as the same run unevaluated, dropout included: the
    same losses, to the bit (the harness seeds the global generators; the evaluation loads its
    own copy of the model)."""
    losses = []
    for name, extra in (("plain", []), ("evaluated", ["--eval-tasks", "toy_mc", "--eval-tasks-include",
                                                      str(made["tasks"]), "--eval-tasks-every", "1",
                                                      "--eval-tasks-limit", "2"])):
        assert main(["train", "--model", "llama-tiny", "--steps", "3", "--dropout", "0.1", "--data",
                     str(made["root"] / "prose.txt"), "--seq-len", str(SEQ), "--micro-batch", "4", "--cache-dir",
                     str(made["root"] / "cache"), *QUIET, "--out", str(tmp_path / name), *extra]) == 0
        records = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(line)["loss"] for line in records])
    assert losses[0] == losses[1] and len(losses[0]) == 3


def _one_sentence(code: int, stderr: str, phrase: str) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("."), stderr
    assert phrase in lines[0], lines[0]


@pytest.mark.parametrize("args, phrase", [
    (["--tasks", "toy_mcq"], "names toy_mcq, which the harness does not find in its registry or --include"),
    (["--include", "{tmp}/nowhere"], "--include {tmp}/nowhere does not exist"),
    (["--from", "{tmp}/nowhere"], "--from {tmp}/nowhere does not exist"),
    (["--tasks", " , "], "--tasks names no task"),
    (["--batch-size", "0"], "--batch-size must be at least 1, not 0"),
    (["--limit", "0"], "--limit must be at least 1, not 0"),
    (["--nproc", "3", "--pp", "3"], "--pp 3 needs at least 3 layers, but the model has 2"),
    (["--tp", "2"], "--tp 2 must divide --nproc 1"),
    (["--nproc", "3", "--tp", "3"], "--tp 3 splits attention into 3 groups of heads, but the model has 4 query heads"),
    (["--fewshot-as-multiturn"], "add --apply-chat-template or drop it"),
    (["--tasks", "toy_missing", "--include", "{tmp}/broken"], "task toy_missing cannot be loaded"),
], ids=["unknown-task", "no-include-folder", "no-model", "no-tasks", "batch-size", "limit", "pp-layers", "tp-nproc",
        "tp-heads", "multiturn", "missing-data"])
def test_eval_mistakes_are_one_sentence(made, tmp_path, capsys, args, phrase):
    broken = tmp_path / "broken"
    broken.mkdir()
    yaml = (made["tasks"] / "toy_mc.yaml").read_text().replace("task: toy_mc", "task: toy_missing")
    (broken / "toy_missing.yaml").write_text(yaml.replace(str(made["tasks"] / "questions.jsonl"),
                                                          str(tmp_path / "gone.jsonl")))
    argv = ["eval", "--from", str(made["bytes"]), "--tasks", "toy_mc", "--include", str(made["tasks"]),
            "--out", str(tmp_path / "out.json")]
    code = main(argv + [arg.format(tmp=tmp_path) for arg in args])
    _one_sentence(code, capsys.readouterr().err, phrase.format(tmp=tmp_path))
    assert not (tmp_path / "out.json").exists()


def test_without_the_harness_installed_eval_says_how_to_install_it(made, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    code = main(["eval", "--from", str(made["bytes"]), "--tasks", "toy_mc"])
    _one_sentence(code, capsys.readouterr().err, "pip install 'scaletrain[eval]'")


@pytest.mark.parametrize("args, phrase", [
    (["--eval-tasks-every", "2"], "--eval-tasks-every applies to the tasks --eval-tasks names; add --eval-tasks"),
    (["--eval-tasks", "toy_mcq", "--eval-tasks-include", "{tasks}"],
     "--eval-tasks names toy_mcq, which the harness does not find in its registry or --eval-tasks-include"),
], ids=["every-without-tasks", "unknown-task"])
def test_training_eval_task_mistakes_are_one_sentence(made, tmp_path, capsys, args, phrase):
    code = main(["train", "--model", "llama-tiny", "--steps", "2", "--data", str(made["root"] / "prose.txt"),
                 "--seq-len", str(SEQ), "--micro-batch", "4", "--cache-dir", str(made["root"] / "cache"), *QUIET,
                 "--out", str(tmp_path / "run"), *[arg.format(tasks=made["tasks"]) for arg in args]])
    _one_sentence(code, capsys.readouterr().err, phrase)
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
