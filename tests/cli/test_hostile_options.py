"""Every option and argument of every command, given hostile values: exit 2, one line naming the option, no
traceback, nothing written. The options are walked from the click objects themselves, so a new option is tested
the day it is added (and must be added to ACCEPTED if one of the hostile values is a legitimate value for it)."""

from __future__ import annotations

import os

import click
import pytest

from moeckpt.cli.main import all_commands, cli

#: what a careless or hostile user types: negative, zero, NaN, infinities, a float overflow, a huge integer,
#: words, nothing, blanks.
HOSTILE = ["-1", "0", "nan", "inf", "-inf", "1e400", "99999999999999999999", "abc", "", "   "]
#: path-like values: any non-blank name may be a file or directory someone means, so only these are hostile
#: for an option that names a place to write to (a name that does not exist is hostile where a file is read).
BLANK = ["", "   "]

#: (command, option) -> the hostile values that are legitimate for it (checked below to convert cleanly).
ACCEPTED: dict[tuple[str, str], set[str]] = {
    ("init", "--seed"): {"0"},
    ("gc", "--keep-every"): {"0"},
    ("gc", "--upload-grace"): {"0"},  # abort every incomplete upload
    ("train", "--muon-momentum"): {"0"},  # Muon without momentum
    ("train", "--bias-update-rate"): {"0"},  # DeepSeek-V3's correction bias held fixed
    ("train", "--seed"): {"0"},
    ("train", "--stop-at"): {"0"},
    ("train", "--warmup-steps"): {"0"},
    ("train", "--min-lr-ratio"): {"0"},
    ("train", "--weight-decay"): {"0"},
    ("train", "--max-grad-norm"): {"0"},
    ("train", "--log-every"): {"0"},
    ("train", "--save-every"): {"0"},
    ("train", "--hang-timeout"): {"0"},
    ("train", "--max-nan-rollbacks"): {"0"},
    ("train", "--max-restarts"): {"0"},
    ("train", "--memory-every"): {"0"},
    ("train", "--memory-replicas"): {"0"},
    ("eval", "--start-sample"): {"0"},
    ("eval", "--seed"): {"0"},
}
#: options and arguments that name a place to write (or a rendezvous id): every non-blank name is legitimate.
NAMES = {
    ("init", "OUT"),
    ("demo", "--dir"),
    ("export-hf", "OUT"),
    ("consolidate", "OUT"),
    ("import-hf", "DST"),
    ("reshard", "DST"),
    ("train", "--run-dir"),
    ("train", "--rdzv-id"),
    ("import-dcp", "DST"),
    ("export-dcp", "OUT"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A checkpoint, a Hugging Face export of it, a run directory and a DCP checkpoint, to point the commands at."""
    root = tmp_path_factory.mktemp("hostile-inputs")
    ck, hf, run, dcp = str(root / "ck"), str(root / "hf"), str(root / "run"), str(root / "dcp")
    for args in (
        ["init", ck, "--model", "zaya-tiny"],
        ["export-hf", ck, hf],
        ["init", os.path.join(run, "step-00000002"), "--model", "zaya-tiny"],
        ["export-dcp", ck, dcp, "--mapping", "none"],
    ):
        cli.main(args, standalone_mode=False)
    return {"ck": ck, "hf": hf, "run": run, "dcp": dcp}


def _baseline(command: str, inputs: dict, out: str) -> tuple[list[str], dict[str, str]]:
    """(arguments, options) of a run of ``command`` that would work: each test replaces one of them."""
    ck, hf, run = inputs["ck"], inputs["hf"], inputs["run"]
    return {
        "init": ([os.path.join(out, "x")], {"--model": "zaya-tiny"}),
        "inspect": ([ck], {}),
        "verify": ([ck], {}),
        "diff": ([ck, ck], {}),
        "gc": ([run], {"--dry-run": None}),
        "demo": ([], {"--dir": os.path.join(out, "demo")}),
        "export-hf": ([ck, os.path.join(out, "hf")], {}),
        "consolidate": ([ck, os.path.join(out, "hf")], {}),
        "import-hf": ([hf, os.path.join(out, "imported")], {}),
        "reshard": ([ck, os.path.join(out, "resharded")], {}),
        "train": (
            [],
            {
                "--model": "zaya-tiny",
                "--run-dir": os.path.join(out, "run"),
                "--steps": "2",
                "--cpu": None,
                "--seq-len": "16",
                "--global-batch": "4",
            },
        ),
        "eval": ([ck], {"--cpu": None}),
        "import-dcp": ([inputs["dcp"], os.path.join(out, "imported")], {}),
        "export-dcp": ([ck, os.path.join(out, "exported")], {"--mapping": "none"}),
    }[command]


def _cases():
    for name, command in all_commands().items():
        for index, param in enumerate(p for p in command.params if isinstance(p, click.Argument)):
            yield pytest.param(name, param.human_readable_name, index, id=f"{name}-{param.human_readable_name}")
        for param in command.params:
            if isinstance(param, click.Option) and not param.is_flag and not param.count:
                yield pytest.param(name, param.opts[0], None, id=f"{name}{param.opts[0]}")


def _argv(command: str, param: str, index: int | None, value: str, inputs: dict, out: str) -> list[str]:
    args, options = _baseline(command, inputs, out)
    args = list(args)
    options = dict(options)
    if index is not None:
        args[index] = value
    else:
        options[param] = value
    argv = [command, *args]
    for opt, v in options.items():
        argv += [opt] if v is None else [opt, v]
    return argv


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns)


@pytest.mark.parametrize("command, param, index", list(_cases()))
def test_hostile_values_are_one_line_and_exit_2(command, param, index, inputs, tmp_path, moeckpt_cli, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)  # a value such as "abc" must not find a file of that name by chance
    # an argument names a file or place: "-1" or "nan" may be one (a name that does not exist is refused with the
    # command's own one line, tests/cli/test_bad_input.py); a blank one never is
    values = BLANK if (command, param) in NAMES or index is not None else HOSTILE
    accepted = ACCEPTED.get((command, param), set())
    tried = 0
    for value in values:
        if value in accepted:
            continue
        argv = _argv(command, param, index, value, inputs, str(out))
        code, stdout, err = moeckpt_cli(*argv)
        lines = [line for line in err.splitlines() if line.strip()]
        where = f"moeckpt {' '.join(argv)!r}: exit {code}\n{err}{stdout}"
        assert code == 2, where
        assert len(lines) == 1 and "Traceback" not in err, where
        assert param in lines[0], where  # the line names the option (or argument)
        assert _files(str(out)) == [], where  # nothing written, committed or not
        tried += 1
    assert tried, f"{command} {param}: every hostile value is listed as accepted"


def test_accepted_values_are_really_accepted():
    """ACCEPTED lists values the option's own type takes (and only options that exist): not a way to skip."""
    commands = all_commands()
    for (name, opt), values in ACCEPTED.items():
        param = next(p for p in commands[name].params if opt in getattr(p, "opts", ()))
        for v in values:
            param.type.convert(v, param, None)  # raises click.BadParameter if the table lies
    for name, opt in NAMES:
        assert any(opt in getattr(p, "opts", ()) or p.human_readable_name == opt for p in commands[name].params)
