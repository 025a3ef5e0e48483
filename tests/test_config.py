
import pytest

from scaletrain.commands.cli import build_parser
from scaletrain.config import Config, load_run_config, load_toml, resolve
from scaletrain.config_checks import check_values
from scaletrain.errors import UserError


def _parse(*argv):
    return build_parser().parse_args(["train", *argv])


def test_flags_override_toml_which_overrides_defaults(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = 7\nlr = 0.002\n[model]\nname = "gpt-tiny"\n')
    cfg = resolve(_parse("--config", str(toml), "--steps", "9"))
    assert cfg.train.steps == 9          # flag beats file
    assert cfg.train.lr == 0.002         # file beats default
    assert cfg.model.name == "gpt-tiny"
    assert cfg.train.micro_batch == Config().train.micro_batch


def test_flat_toml_keys_use_flag_names(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('model = "mlp"\nmicro_batch = 3\n')
    assert load_toml(toml) == {"name": "mlp", "micro_batch": 3}


def test_saved_config_round_trips(tmp_path):
    cfg = Config().replace(steps=5, dp=2, name="gpt-tiny", data="x.txt")
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    assert load_run_config(tmp_path) == cfg


@pytest.mark.parametrize("text, phrase", [
    ("[train]\nsteps = 'many'\n", "must be int"),
    ("[train]\nnot_a_field = 1\n", "unknown key 'not_a_field'"),
    ("bogus = 1\n", "unknown key 'bogus'"),
    ("[model]\nname = 'gpt-huge'\n", "must be one of"),
    ("steps = [\n", "not valid TOML"),
])
def test_bad_toml_is_one_clear_sentence(tmp_path, text, phrase):
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(UserError, match=phrase):
        load_toml(toml)


@pytest.mark.parametrize("changes, phrase", [
    ({"steps": 0}, "--steps must be at least 1"),
    ({"grad_accum": -1}, "--grad-accum must be at least 1"),
    ({"val_fraction": 1.5}, "--val-fraction"),
    ({"stop_at": 99, "steps": 10}, "--stop-at"),
    ({"peak_tflops": "fast"}, "--peak-tflops"),
])
def test_value_checks(changes, phrase):
    with pytest.raises(UserError, match=phrase):
        check_values(Config().replace(**changes))


def test_every_field_has_a_flag():
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    for section in ("model", "data", "train", "parallel", "run"):
        for name in getattr(Config(), section).__dataclass_fields__:
            assert (name if name != "name" else "model") in flags


def test_a_mixture_of_experts_preset_brings_its_experts_unless_the_flag_says_otherwise():
    assert resolve(_parse("--model", "mixtral-8x7b")).model.moe_experts == 8
    assert resolve(_parse("--model", "mixtral-8x7b", "--moe-experts", "4")).model.moe_experts == 4
    assert resolve(_parse("--model", "llama-tiny")).model.moe_experts == 0
