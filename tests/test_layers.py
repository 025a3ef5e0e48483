"""Where the whole configuration goes: the layer that describes runs (the verbs in commands/, a
run in job/, the planner, the benches, the library's setup) holds the whole `Config`, resolved
once at the top; every module that does the work (the engine in train/, the parallel transforms,
the models, data, optimizers, kernels, runtime, techniques and fine-tuning parts) receives the
resolved section it uses, never the whole (docs/architecture.md)."""

import ast
from pathlib import Path

from scaletrain import config

PACKAGE = Path(config.__file__).parent
WORK_FOLDERS = ("train", "parallel", "models", "data", "optim", "kernels", "runtime", "techniques", "finetune")
SECTIONS = {section.__name__ for section in config.SECTIONS.values()}  # ModelConfig, TrainConfig, ...


def names_from_config(source: str) -> set[str]:
    """Every name a module takes from scaletrain.config, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "scaletrain.config":
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {"the whole module" for alias in node.names if alias.name == "scaletrain.config"}
    return names


def test_no_working_module_takes_more_than_a_section():
    taken = {str(path.relative_to(PACKAGE)): names_from_config(path.read_text()) - SECTIONS
             for folder in WORK_FOLDERS for path in sorted((PACKAGE / folder).rglob("*.py"))}
    assert {path: names for path, names in taken.items() if names} == {}


def test_the_check_would_see_the_whole_config_taken():
    source = ("from scaletrain.config import Config, TrainConfig\n"
              "def f():\n    from scaletrain.config import load_run_config\n"
              "import scaletrain.config\n")
    assert names_from_config(source) - SECTIONS == {"Config", "load_run_config", "the whole module"}
