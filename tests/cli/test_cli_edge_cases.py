"""CLI edge cases: 0-d tensors in ``diff``, malformed model configs, the zarr doc snippet, honest stored sizes."""

from __future__ import annotations

import torch

from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.save import save_full_tensors


def _save_with_scalar(location: str, backend: str, scalar: float) -> None:
    tensors = {
        "scale": TensorEntry(name="scale", shape=(), dtype="float32", role="buffer", param="scale"),
        "w": TensorEntry(name="w", shape=(4, 3), dtype="float32", role="buffer", param="w"),
    }
    values = {
        "scale": torch.tensor(scalar, dtype=torch.float32),
        "w": torch.arange(12, dtype=torch.float32).reshape(4, 3),
    }
    save_full_tensors(
        location,
        tensors=tensors,
        layout=Layout(dp=2),
        values=lambda e: values[e.name],
        model={"arch": "toy", "config": {}},
        backend=backend,
    )


def test_diff_compares_scalar_tensors_bitwise(tmp_path, backend, moeckpt_cli):
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    _save_with_scalar(a, backend, 1.5)
    _save_with_scalar(b, backend, 1.5)
    _save_with_scalar(c, backend, 2.0)
    code, out, err = moeckpt_cli("diff", a, a)
    assert code == 0 and "identical: 2 tensors" in out, (out, err)
    code, out, err = moeckpt_cli("diff", a, b)
    assert code == 0 and "Traceback" not in err, (out, err)
    code, out, err = moeckpt_cli("diff", a, c)
    assert code == 1, (out, err)
    assert out.splitlines() == ["scale: max abs diff 0.5"]
    assert "1 tensor(s) differ" in err
    # a NaN scalar equals itself bit for bit
    n1, n2 = str(tmp_path / "n1"), str(tmp_path / "n2")
    _save_with_scalar(n1, backend, float("nan"))
    _save_with_scalar(n2, backend, float("nan"))
    assert moeckpt_cli("diff", n1, n2)[0] == 0


# --- model config files -------------------------------------------------------------------------------------


def _init_with_config(tmp_path, moeckpt_cli, doc):
    import json
    import time

    path = tmp_path / "model.json"
    path.write_text(json.dumps(doc))
    t0 = time.monotonic()
    code, out, err = moeckpt_cli("init", tmp_path / "ck", "--model", path)
    assert time.monotonic() - t0 < 10, "refused only after building the model"
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(path) in lines[0]
    assert not (tmp_path / "ck").exists()
    return lines[0]


def test_init_refuses_flat_model_fields(tmp_path, moeckpt_cli):
    line = _init_with_config(tmp_path, moeckpt_cli, {"arch": "zaya", "hidden_size": 64, "num_hidden_layers": 2})
    assert "unexpected top-level key(s) hidden_size, num_hidden_layers" in line
    assert 'belong under "config"' in line


def test_init_refuses_missing_config_object(tmp_path, moeckpt_cli):
    line = _init_with_config(tmp_path, moeckpt_cli, {"arch": "zaya"})
    assert 'needs a "config" object' in line


def test_init_refuses_unknown_config_field(tmp_path, moeckpt_cli):
    line = _init_with_config(tmp_path, moeckpt_cli, {"arch": "zaya", "config": {"hidden_size": 64, "hiden_layers": 2}})
    assert "unknown zaya config field(s) hiden_layers" in line and "num_hidden_layers" in line


def test_init_reports_invalid_config_values_on_one_line(tmp_path, moeckpt_cli):
    line = _init_with_config(tmp_path, moeckpt_cli, {"arch": "zaya", "config": {"num_attention_heads": 3}})
    assert "zaya config is invalid" in line and "num_key_value_heads" in line


def test_init_accepts_a_nested_config(tmp_path, moeckpt_cli):
    import json

    from moeckpt.trainer.models import presets

    path = tmp_path / "model.json"
    path.write_text(json.dumps(presets()["zaya-tiny"].to_json()))
    code, out, err = moeckpt_cli("init", tmp_path / "ck", "--model", path)
    assert code == 0, (out, err)
    assert moeckpt_cli("diff", tmp_path / "ck", tmp_path / "ck")[0] == 0


# --- docs/zarr.md's plain-zarr snippet ----------------------------------------------------------------------


def _zarr_doc_snippet() -> str:
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "zarr.md").read_text(encoding="utf-8")
    section = doc.split("## Reading one tensor with plain zarr", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "docs/zarr.md: expected one python block under 'Reading one tensor with plain zarr'"
    return blocks[0]


def test_zarr_doc_snippet_reads_a_real_tensor(tmp_path, moeckpt_cli):
    import re

    from moeckpt.formats.checkpoint import CheckpointReader

    ckpt = tmp_path / "ck"
    code, out, err = moeckpt_cli(
        "init", ckpt, "--model", "zaya-tiny", "--with-optimizer", "--format", "zarr", "--dp", "2"
    )
    assert code == 0, (out, err)
    snippet = _zarr_doc_snippet()
    stores = re.findall(r'store="([^"]*)"', snippet)
    assert len(stores) == 1
    name = re.search(r'path="([^"]*)"', snippet).group(1)
    namespace: dict = {}
    exec(compile(snippet.replace(f'store="{stores[0]}"', f"store={str(ckpt)!r}"), "docs/zarr.md", "exec"), namespace)
    want = CheckpointReader(str(ckpt)).read_tensor(name)
    got = namespace["t"]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    # the layout tree names the same array, and its c/0/0 and c/1/0 objects exist at dp=2
    doc_tree = _zarr_doc_tree()
    assert f"{name}/" in doc_tree
    assert (ckpt / name / "c" / "0" / "0").is_file() and (ckpt / name / "c" / "1" / "0").is_file()


def _zarr_doc_tree() -> str:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "zarr.md").read_text(encoding="utf-8")
    return doc.split("## Layout", 1)[1].split("\n## ", 1)[0]


# --- inspect: stored bytes -----------------------------------------------------------------------------------


def _stored_on_storage(location: str) -> tuple[int, int]:
    """Bytes and count of every object of a checkpoint, its index moeckpt.json left out, measured independently."""
    from moeckpt.formats.storages import open_storage

    from ..helpers import list_objects

    s = open_storage(location)
    paths = [p for p in list_objects(location) if p != "moeckpt.json"]
    return sum(s.size(p) for p in paths), len(paths)


def test_inspect_stored_bytes_count_every_object(storage_url, backend, moeckpt_cli):
    import json

    from moeckpt.reshard.layout import Layout

    from ..helpers import save_toy

    save_toy(storage_url, Layout(tp=2, dp=2), backend=backend)
    code, out, err = moeckpt_cli("inspect", storage_url, "--json")
    assert code == 0, err
    info = json.loads(out)
    want_bytes, want_objects = _stored_on_storage(storage_url)
    assert (info["stored_bytes"], info["stored_objects"]) == (want_bytes, want_objects)
    assert info["stored_bytes"] >= info["logical_bytes"]
    if backend == "zarr":  # the index lists only the zarr.json documents; the chunk objects are the data
        assert info["stored_objects"] > len(info["files"])
        assert info["stored_bytes"] > sum(f["size"] for f in info["files"].values()) + info["logical_bytes"] // 2
    code, text, _ = moeckpt_cli("inspect", storage_url)
    assert f"{info['stored_bytes'] / 1e6:,.2f} MB stored" in text


def test_inspect_zarr_stored_bytes_with_a_scalar_and_stray_files(tmp_path, moeckpt_cli):
    import json

    loc = tmp_path / "ck"
    _save_with_scalar(str(loc), "zarr", 1.5)
    want_bytes, want_objects = _stored_on_storage(str(loc))
    assert (loc / "scale" / "c").is_file()  # a 0-d array's one chunk object is "<name>/c"
    (loc / "notes.txt").write_bytes(b"x" * 1000)  # not part of the checkpoint: not counted
    info = json.loads(moeckpt_cli("inspect", loc, "--json")[1])
    assert (info["stored_bytes"], info["stored_objects"]) == (want_bytes, want_objects)


def test_the_program_imports_with_the_collector_off_and_freezes_them_without_a_collection():
    """Run as the ``moeckpt`` program, the cyclic collector is off while a command's modules are imported and on
    again once they are frozen, with no collection in between (it cost about a tenth of a second of every start);
    imported by a test or a tool instead, the collector is left as it was."""
    import subprocess
    import sys

    program = """
import gc, sys
import click
sys.argv = ["moeckpt", "inspect", "--help"]
import moeckpt.cli.main as m
assert not gc.isenabled() and m._COLLECTOR_OFF
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
m.cli.get_command(click.Context(m.cli), "inspect")
assert gc.isenabled() and gc.get_freeze_count() > 0 and not full, (gc.isenabled(), gc.get_freeze_count(), full)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    as_a_module = "import gc, moeckpt.cli.main as m; assert gc.isenabled() and not m._COLLECTOR_OFF"
    done = subprocess.run([sys.executable, "-c", as_a_module], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
