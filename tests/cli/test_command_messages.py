"""What the commands tell their user: a refusal is one line naming the option or the path to change, progress and
saves are reported, an overwrite says what it removed, and an interrupted or failed command leaves nothing behind
(each numbered defect and each piece of friction a new user met in issue 18, as it must behave now)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from moeckpt.formats.checkpoint import committed_steps
from moeckpt.trainer.data import default_text_path

TINY = ("--model", "zaya-tiny", "--seq-len", "16", "--global-batch", "4", "--cpu", "--warmup-steps", "1")


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- 18.2: train options out of range are one line, not a traceback ----------------------------------------


@pytest.mark.parametrize("option, value", [("--lr", "-1"), ("--lr", "nan"), ("--max-grad-norm", "-1")])
def test_train_refuses_bad_optimizer_values(option, value, tmp_path, moeckpt_cli):
    code, _, err = moeckpt_cli("train", *TINY, "--run-dir", tmp_path / "r", option, value)
    assert code == 2 and option in _one_line(err)
    assert not (tmp_path / "r").exists()


# -- 18.4: gc of what is not a run directory ----------------------------------------------------------------


def test_gc_refuses_what_is_not_a_run_directory(tmp_path, moeckpt_cli):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    code, _, err = moeckpt_cli("init", tmp_path / "ck", "--model", "zaya-tiny")
    assert code == 0, err
    for path, why in (
        (tmp_path / "nope", "no such run directory"),
        (tmp_path / "empty", "is empty"),
        (tmp_path / "file", "is a file"),
        (tmp_path / "ck", "is a checkpoint"),
    ):
        code, out, err = moeckpt_cli("gc", path)
        assert code == 2 and why in _one_line(err) and "kept" not in out, (path, out, err)


# -- 18.5: the "nothing to do" line names the run's step ---------------------------------------------------


def test_nothing_to_do_names_the_runs_step(tmp_path, moeckpt_cli):
    run = tmp_path / "run"
    code, _, err = moeckpt_cli("train", *TINY, "--run-dir", run, "--steps", "6", "--save-every", "3")
    assert code == 0, err
    code, out, _ = moeckpt_cli("train", *TINY, "--run-dir", run, "--steps", "3")
    assert code == 0 and "already at step 6 (--steps 3)" in out, out
    code, out, _ = moeckpt_cli("train", *TINY, "--run-dir", tmp_path / "fresh", "--steps", "4", "--stop-at", "0")
    assert code == 0 and "already at step 0 (--stop-at 0)" in out, out
    # with two workers the line comes from rank 0's report, not from the old metrics ("step 6/3")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeckpt.cli.main",
            "train",
            *TINY,
            "--run-dir",
            str(run),
            "--steps",
            "3",
            "--nproc",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert "already at step 6 (--steps 3)" in r.stdout and "6/3" not in r.stdout, r.stdout


# -- 18.6: export-hf stages and commits ---------------------------------------------------------------------


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("layout", [(), ("--tp", "2", "--dp", "2")], ids=["tp1", "tp2"])
def test_export_of_a_damaged_source_names_it_and_leaves_nothing(tmp_path, moeckpt_cli, layout):
    """The export maps its reads (a TP-split source's halves too) and still verifies every byte it reads."""
    ck, out = tmp_path / "ck", tmp_path / "hf"
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny", *layout)[0] == 0
    _flip_last_byte(str(ck / "rank-00000.safetensors"))
    code, _, err = moeckpt_cli("export-hf", ck, out)
    line = _one_line(err)
    assert code == 2 and "rank-00000.safetensors" in line and "checksum mismatch" in line
    assert str(out) not in line  # the source's problem, not the output file's
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".hf")]
    # a clean source exports to the same OUT without --overwrite: nothing of the failed export is in the way
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny", *layout, "--overwrite")[0] == 0
    code, _, err = moeckpt_cli("export-hf", ck, out)
    assert code == 0 and sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


def test_an_interrupted_export_leaves_nothing(tmp_path, moeckpt_cli, monkeypatch):
    import moeckpt.trainer.hf_export as hf_export

    ck, out = tmp_path / "ck", tmp_path / "hf"
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny")[0] == 0
    calls = []
    real = hf_export.value_bytes  # what every HF tensor's bytes pass through on their way to the shard

    def interrupted_midway(t):
        calls.append(1)
        if len(calls) == 20:
            signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, half way through the shard
        return real(t)

    monkeypatch.setattr(hf_export, "value_bytes", interrupted_midway)
    code, _, err = moeckpt_cli("export-hf", ck, out, "--max-shard-size", "100KB")
    assert code == 130 and _one_line(err) == "moeckpt: interrupted"
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".hf")]


def test_export_overwrite_keeps_foreign_files_and_says_what_it_replaced(tmp_path, moeckpt_cli):
    ck, out = tmp_path / "ck", tmp_path / "hf"
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny")[0] == 0
    assert moeckpt_cli("export-hf", ck, out)[0] == 0
    (out / "tokenizer.json").write_text("{}")
    code, _, err = moeckpt_cli("export-hf", ck, out)
    assert code == 2 and "--overwrite" in _one_line(err)
    code, _, err = moeckpt_cli("export-hf", ck, out, "--overwrite")
    assert code == 0 and "--overwrite: removed" in err and (out / "tokenizer.json").exists()


# -- 18.7: eval past the end of the data --------------------------------------------------------------------


def test_eval_refuses_batches_past_the_data(tmp_path, moeckpt_cli):
    ck = tmp_path / "ck"
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny")[0] == 0
    code, _, err = moeckpt_cli("eval", ck, "--seq-len", "64", "--batch-size", "8", "--batches", "800")
    assert code == 2 and "--batches" in _one_line(err) and "at most --batches 781" in err
    code, _, err = moeckpt_cli("eval", ck, "--start-sample", "99999999")
    assert code == 2 and "--start-sample" in _one_line(err)
    # in the trainer's shuffled order a later epoch is legitimate, and the line says so
    code, out, err = moeckpt_cli("eval", ck, "--start-sample", "99999999", "--shuffle", "--batches", "1")
    assert code == 0 and "epoch" in out, err


# -- 18.8: verify's rule ------------------------------------------------------------------------------------


def test_verify_fails_a_corrupt_index_and_a_corrupt_data_file_alike(tmp_path, moeckpt_cli):
    a, b = tmp_path / "a", tmp_path / "b"
    for ck in (a, b):
        assert moeckpt_cli("init", ck, "--model", "zaya-tiny")[0] == 0
    (a / "moeckpt.json").write_text("{ not json")
    _flip_last_byte(str(b / "rank-00000.safetensors"))
    for ck, what in ((a, "moeckpt.json"), (b, "rank-00000.safetensors")):
        code, _, err = moeckpt_cli("verify", ck)
        assert code == 1 and what in err and "verify failed" in err and "Traceback" not in err, err
    code, _, err = moeckpt_cli("verify", tmp_path / "nothing")
    assert code == 2 and "no such checkpoint" in _one_line(err)


# -- 18.11: more samples per step than the data has ----------------------------------------------------------


def test_a_global_batch_larger_than_the_data_is_refused_at_once(tmp_path, moeckpt_cli):
    t0 = time.monotonic()
    code, _, err = moeckpt_cli(
        "train",
        "--model",
        "zaya-tiny",
        "--cpu",
        "--run-dir",
        tmp_path / "r",
        "--global-batch",
        "100000",
        "--steps",
        "2",
    )
    assert code == 2 and "--global-batch" in _one_line(err) and "samples" in err
    assert time.monotonic() - t0 < 20 and not (tmp_path / "r").exists()


# -- friction -----------------------------------------------------------------------------------------------


def test_train_shows_progress_and_one_line_per_save(tmp_path, moeckpt_cli):
    code, out, err = moeckpt_cli(
        "train", *TINY, "--run-dir", tmp_path / "r", "--steps", "6", "--save-every", "3", "--log-every", "2"
    )
    assert code == 0, err
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["2/6", "4/6", "6/6"], out
    for word in ("loss", "lr", "grad norm", "tok/s", "save blocked", "ETA"):
        assert word in progress[0], progress[0]
    assert [line for line in err.splitlines() if "saved step" in line] == [
        line for line in err.splitlines() if line.startswith("moeckpt: saved step")
    ] and err.count("saved step") == 2
    # a resume in another process count is one line naming the layout change; -q silences progress
    code, out, err = moeckpt_cli("-q", "train", *TINY, "--run-dir", tmp_path / "r", "--steps", "8", "--log-every", "1")
    assert code == 0 and not [line for line in out.splitlines() if line.startswith("step ")] and "resumed" not in err


def test_help_texts_say_what_a_new_user_asks(moeckpt_cli):
    code, out, _ = moeckpt_cli("init", "--help")
    assert code == 0 and all(p in out for p in ("zaya-tiny", "zaya-small", "zaya1-8b", "qwen3moe-tiny"))
    code, out, _ = moeckpt_cli("demo", "--help")
    assert code == 0 and "2 workers" in out and "lost" in out and "--dir" in out
    code, out, _ = moeckpt_cli("eval", "--help")
    assert code == 0 and "shipped demo text" in out


def test_eval_defaults_to_the_shipped_data_like_train(tmp_path, moeckpt_cli):
    ck = tmp_path / "ck"
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny")[0] == 0
    code, out, err = moeckpt_cli("eval", ck, "--batches", "1")
    assert code == 0 and os.path.basename(default_text_path()) in out, err


def test_hints_name_the_option_to_pass(tmp_path, moeckpt_cli):
    data = tmp_path / "tokens.dat"
    data.write_bytes(b"\x01\x00" * 1000)
    code, _, err = moeckpt_cli("train", *TINY, "--run-dir", tmp_path / "r", "--data", data)
    assert code == 2 and "--data-dtype" in _one_line(err)
    code, _, err = moeckpt_cli("train", *TINY, "--run-dir", tmp_path / "r", "--tp", "2")
    assert code == 2 and "--nproc" in _one_line(err)


def test_init_overwrite_of_a_run_directory_says_what_it_removed(tmp_path, moeckpt_cli):
    run = tmp_path / "run"
    assert moeckpt_cli("train", *TINY, "--run-dir", run, "--steps", "4", "--save-every", "2")[0] == 0
    code, _, err = moeckpt_cli("init", run, "--model", "zaya-tiny", "--overwrite")
    assert code == 0 and "removed the run directory" in err and "2 committed checkpoint(s)" in err, err


def test_inspect_summarises_zarr_metadata(tmp_path, moeckpt_cli):
    ck = tmp_path / "ck"
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny", "--format", "zarr", "--dp", "2")[0] == 0
    code, out, _ = moeckpt_cli("inspect", ck)
    assert code == 0 and "zarr.json metadata documents" in out
    assert not [line for line in out.splitlines() if line.strip().endswith("zarr.json") or "/zarr.json " in line]


def test_an_unreachable_s3_endpoint_is_one_line_in_seconds(tmp_path, monkeypatch, moeckpt_cli):
    from moeckpt.trainer.local_world import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    for cmd in (("inspect", "s3://bucket/run"), ("train", *TINY, "--run-dir", "s3://bucket/run")):
        t0 = time.monotonic()
        code, _, err = moeckpt_cli(*cmd)
        assert code == 2 and "unreachable" in _one_line(err) and "AWS_ENDPOINT_URL_S3" in err
        assert time.monotonic() - t0 < 5


def test_nothing_of_a_run_stays_in_the_temporary_directory(tmp_path, monkeypatch, request):
    """torchrun's log directory, the workers' status files and torch.multiprocessing's error pickles go where they
    are cleaned up (a private temporary directory here, so other jobs' files do not count)."""
    from moeckpt.trainer.local_world import run_local_world

    from ..trainer.test_parallel import _fail_on_rank_one

    # a short path: under xdist tmp_path is deep, and a forkserver's AF_UNIX socket path in it would be too long
    private = Path(tempfile.mkdtemp(prefix="moeckpt-t-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(private, ignore_errors=True))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    with pytest.raises(Exception, match="rank one fails on purpose"):
        run_local_world(_fail_on_rank_one, 2, timeout_s=60)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeckpt.cli.main",
            "train",
            *TINY,
            "--run-dir",
            str(tmp_path / "r"),
            "--steps",
            "2",
            "--nproc",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(private)},
    )
    assert r.returncode == 0, r.stderr
    assert [s for s, _ in committed_steps(str(tmp_path / "r"))] == [2]
    assert os.listdir(private) == []


def test_the_first_readme_command_installs_the_loss_plot():
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(root, "README.md")).read()
    extra = readme.split("-e '.[", 1)[1].split("]'", 1)[0]
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in extras[extra]}
    assert {"matplotlib", "transformers"} <= names, (extra, names)
    assert json.loads(json.dumps(extras))  # the file parses
