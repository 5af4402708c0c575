"""TrainConfig is the one source of ``moeckpt train``'s options: one option per field and one field per option,
with the same default and help, grouped by section; the config travels to the workers as JSON unchanged."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields

import click
import pytest

from moeckpt.cli.main import all_commands
from moeckpt.trainer.config import SECTIONS, TrainConfig


def _train() -> click.Command:
    return all_commands()["train"]


def _options() -> dict[str, click.Option]:
    return {p.name: p for p in _train().params if isinstance(p, click.Option) and p.name != "help"}


def test_each_field_is_exactly_one_option_and_each_option_one_field():
    options = _options()
    names = [f.name for f in fields(TrainConfig)]
    assert sorted(options) == sorted(names)
    for f in fields(TrainConfig):
        opt = options[f.name]
        assert opt.help == f.metadata["help"], f.name
        spelled = (f.metadata.get("option") or "--" + f.name.replace("_", "-")).split("/")
        assert opt.opts == spelled[:1] and opt.secondary_opts == spelled[1:], f.name
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else MISSING)
        )
        if default is MISSING:
            assert opt.required, f.name
        elif default in ("", None, ()):
            assert opt.default in (None, ()), f.name  # the field's own default applies
        else:
            got = opt.type.convert(opt.default, opt, None) if not opt.is_flag else opt.default
            assert got == default, (f.name, opt.default, default)


def test_every_field_has_a_section_and_help_lists_them_in_order(moeckpt_cli):
    for f in fields(TrainConfig):
        assert f.metadata["section"] in SECTIONS and f.metadata["help"], f.name
    assert all(TrainConfig.sections()[s] for s in SECTIONS)
    code, out, _ = moeckpt_cli("train", "--help")
    assert code == 0
    headings = [line.strip() for line in out.splitlines() if line.strip().endswith(" options:")]
    assert headings[: len(SECTIONS)] == [f"{s.capitalize()} options:" for s in SECTIONS]
    for f in fields(TrainConfig):
        assert TrainConfig.option_name(f) in out, f.name


def test_json_round_trip_to_the_workers():
    cfg = TrainConfig(
        model="zaya-tiny",
        run_dir="r",
        ep=None,
        inject=("slow:step=1,seconds=0.1",),
        stop_at=3,
        nnodes="1:2",
        rdzv_endpoint="h:1",
        lr=1e-3,
        async_save=False,
    )
    assert TrainConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        TrainConfig.from_json({**cfg.to_json(), "lr_typo": 1})


@pytest.mark.parametrize(
    "field, value",
    [
        ("lr", -1.0),
        ("lr", float("nan")),
        ("lr", 0.0),
        ("max_grad_norm", -1.0),
        ("weight_decay", float("inf")),
        ("steps", 0),
        ("steps", True),
        ("seq_len", 10**12),
        ("seed", -1),
        ("global_batch", "8"),
        ("tp", 1.5),
        ("hang_timeout_s", -3.0),
        ("rdzv_conf", "abc"),
        ("format", "hdf5"),
        ("data", ""),
        ("run_dir", ""),
    ],
)
def test_the_python_api_refuses_what_the_options_refuse(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        TrainConfig(**{"model": "zaya-tiny", "run_dir": "r", field: value})
