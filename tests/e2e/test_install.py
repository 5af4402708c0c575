"""What a fresh install relies on: README.md's two set-up commands (CI runs them verbatim, .ci/run), and that
nothing the CLI or the trainer runs needs an extra or the test-only package ``moeckpt.testing``.

The plain install (a built wheel, no extra) runs in a brand-new venv in CI (.ci/installs); these tests hold the
rules it relies on, and what each extra alone promises, in the suite's own venv with the other extras' packages
made unimportable: the hf extra here, the plot extra beside the demo's drill (tests/e2e/test_demo.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ..proc_helpers import run_python_without

ROOT = Path(__file__).resolve().parents[2]


def _ci_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / ".ci" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


readme = _ci_module("readme_commands")


def test_readme_holds_exactly_the_two_setup_commands_ci_runs():
    commands = readme.readme_commands((ROOT / "README.md").read_text())
    assert commands["main"].endswith("&& moeckpt demo")
    assert "-e '.[demo]'" in commands["main"]
    assert commands["test"].rsplit("&&", 1)[-1].strip().startswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()  # CI reads both out of README.md and runs them, not a copy of them
    assert "readme_commands.py main)" in ci and "readme_commands.py test)" in ci
    assert 'bash -c "$main_job"' in ci and 'bash -c "$tests"' in ci
    assert commands["test"] not in ci and commands["main"] not in ci


@pytest.mark.parametrize(
    "text, problem",
    [
        ("```bash\npython3 -m venv a && moeckpt demo\n```\n", "1 set-up commands"),
        (
            "```bash\npython3 -m venv a && moeckpt demo\n```\n```bash\npython3 -m venv b && python -m pytest\n```\n"
            "```bash\npython3 -m venv c && pip install .\n```\n",
            "3 set-up commands",
        ),
        ("```\npython3 -m venv a && pip install .\n```\n```\npython3 -m venv b && python -m pytest\n```\n", "demo"),
        ("```\npython3 -m venv a && moeckpt demo\n```\n```\npython3 -m venv b && pip install .\n```\n", "pytest"),
    ],
)
def test_a_readme_with_other_setup_commands_fails_the_check(text, problem):
    with pytest.raises(readme.ReadmeError, match=problem):
        readme.readme_commands(text)


#: run in a fresh interpreter where pytest, transformers, matplotlib and moto cannot be imported (as in a
#: no-extra install): the whole CLI (every command's module, through --help) and the trainer's entry points.
_WITHOUT_EXTRAS = r"""
from moeckpt.cli.main import cli
for command in [None, *cli.commands]:
    try:
        cli.main([command, "--help"] if command else ["--help"], standalone_mode=False)
    except SystemExit as e:
        assert not e.code, (command, e.code)
import moeckpt, moeckpt.dcp, moeckpt.trainer.train, moeckpt.trainer.elastic_drill, moeckpt.trainer.launch
leaked = sorted(m for m in sys.modules if m.startswith("moeckpt.testing"))
assert not leaked, f"the CLI or trainer imported the test-only package: {leaked}"
import moeckpt.testing  # works without pytest: only the suites need it
try:
    moeckpt.testing.BackendTests
except ImportError as e:
    assert "pip install pytest" in str(e) and "\n" not in str(e), repr(e)
else:
    raise AssertionError("BackendTests without pytest")
print("clean")
"""


#: the ``hf`` extra alone (transformers; matplotlib, pytest and moto unimportable, as in such an install): an
#: export of a checkpoint loads in transformers whole and computes our logits.
_HF_EXTRA_ALONE = r"""
from moeckpt.cli.main import cli
work = sys.argv[1]
for args in (["init", work + "/ck", "--model", "zaya-tiny", "--ep", "2", "--dp", "2"],
             ["export-hf", work + "/ck", work + "/hf"]):
    try:
        cli.main(args, standalone_mode=False)
    except SystemExit as e:
        assert not e.code, (args, e.code)
from moeckpt.trainer.hf_check import logits_difference
print("logits difference", logits_difference(work + "/ck", work + "/hf"))
"""


def test_the_hf_extra_alone_exports_what_transformers_loads_with_our_logits(tmp_path):
    p = run_python_without(("pytest", "_pytest", "matplotlib", "moto"), _HF_EXTRA_ALONE, str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert float(p.stdout.split("logits difference")[-1]) < 1e-4, p.stdout


def test_the_wheel_lists_every_package_of_the_source_tree():
    """The editable install of the test venv finds any folder; a wheel holds only the packages pyproject.toml
    names, so a new subpackage left off the list imports here and fails on every plain install."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((package, *rel)))
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "pyproject.toml lists packages with no folder"


def test_the_cli_and_trainer_run_without_pytest_or_any_extra():
    p = run_python_without(("pytest", "_pytest", "transformers", "matplotlib", "moto"), _WITHOUT_EXTRAS)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("clean")


def test_demo_without_its_extra_says_which_in_one_line(moeckpt_cli, monkeypatch, tmp_path):
    from moeckpt.cli import demo_cmd

    real = importlib.util.find_spec
    monkeypatch.setattr(
        demo_cmd.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    code, out, err = moeckpt_cli("demo", "--dir", tmp_path / "demo")
    assert code == 2
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'moeckpt[demo]'" in lines[0] and "matplotlib" in lines[0], lines
    assert not (tmp_path / "demo").exists()  # refused before it made anything


def test_the_wheel_check_wants_every_module_and_data_file_and_names_one_missing(tmp_path, capsys):
    import zipfile

    check = _ci_module("check_wheel")
    wanted = check.expected_files(ROOT)
    data = {f"moeckpt/trainer/data/{p.name}" for p in (ROOT / "trainer" / "data").glob("*.txt")}
    assert data and data <= wanted
    assert {"moeckpt/__init__.py", "moeckpt/trainer/models/zaya/__init__.py", "moeckpt/cli/main.py"} <= wanted
    assert not any("__pycache__" in w or w.startswith(("moeckpt/moeckpt/", "moeckpt/trainer/trainer/")) for w in wanted)
    whole, short = tmp_path / "whole.whl", tmp_path / "short.whl"
    for path, names in ((whole, wanted), (short, wanted - {"moeckpt/trainer/models/zaya/__init__.py"})):
        with zipfile.ZipFile(path, "w") as z:
            for name in names:
                z.writestr(name, "")
    assert check.main([str(whole), str(ROOT)]) == 0
    assert check.main([str(short), str(ROOT)]) == 1
    assert "lacks moeckpt/trainer/models/zaya/__init__.py" in capsys.readouterr().err
