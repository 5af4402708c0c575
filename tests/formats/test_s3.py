"""S3 through moto's server: the CLI on s3:// URLs, faults mid-save, a missing bucket, retries."""

from __future__ import annotations

import errno

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from moeckpt.formats import errors
from moeckpt.formats.checkpoint import CheckpointReader, save_pieces, step_dir_name, verify
from moeckpt.formats.index import Index
from moeckpt.formats.pieces import Piece
from moeckpt.formats.storages import open_storage
from moeckpt.formats.storages import retry as retry_mod
from moeckpt.formats.storages import url as url_mod
from moeckpt.formats.storages.retry import RetryPolicy
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import placements

from ..helpers import list_objects, save_toy, tensors_equal, toy_tensors, toy_values
from ..s3_fixtures import FaultyProxy, make_bucket

FAST_RETRY = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.05)


def test_cli_init_verify_inspect_diff_on_s3(s3_url, moeckpt_cli, tmp_path):
    """The CLI on an s3:// URL: a zarr checkpoint there equals a local safetensors one in another layout."""
    model = ("--model", "qwen3moe-tiny", "--with-optimizer", "--seed", "3")
    code, out, err = moeckpt_cli("init", s3_url, *model, "--tp", "2", "--dp", "2", "--ep", "2", "--format", "zarr")
    assert code == 0, err
    code, out, err = moeckpt_cli("verify", s3_url)
    assert code == 0, out + err
    code, out, err = moeckpt_cli("inspect", s3_url, "--json")
    assert code == 0 and "zarr" in out
    local = str(tmp_path / "local")
    assert moeckpt_cli("init", local, *model, "--format", "safetensors")[0] == 0
    code, out, err = moeckpt_cli("diff", s3_url, local)
    assert code == 0, out + err


def test_missing_bucket_is_one_line_and_exit_2(moto_endpoint, moeckpt_cli):
    code, out, err = moeckpt_cli("inspect", "s3://nope-no-such-bucket/x")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "nope-no-such-bucket" in lines[0] and "does not exist" in lines[0], err
    code, out, err = moeckpt_cli("init", "s3://nope-no-such-bucket/x", "--model", "zaya-tiny")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err, err


def _pieces_by_writer(layout: Layout) -> tuple[dict, dict[int, list[Piece]]]:
    tensors, values = toy_tensors(), toy_values()
    by_writer: dict[int, list[Piece]] = {r: [] for r in range(layout.world)}
    for entry in tensors.values():
        full = values(entry)
        for p in placements(entry, layout):
            by_writer[p.writer].append(Piece(entry.name, p.box, full[p.box.slices()]))
    return tensors, by_writer


def _index(tensors, layout: Layout, backend: str) -> Index:
    return Index(
        backend=backend,
        step=10,
        layout=layout.to_json(),
        model={"arch": "toy", "config": {}},
        tensors=tensors,
        files={},
    )


@pytest.fixture
def flaky_s3(moto_endpoint, monkeypatch):
    """The moto server behind a proxy that a test can make reset every connection; fast retries meanwhile."""
    proxy = FaultyProxy(moto_endpoint)
    make_bucket(moto_endpoint, "flaky")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    monkeypatch.setattr(retry_mod, "DEFAULT_RETRY", FAST_RETRY)
    # botocore's and s3fs's own retries, short, so that a dead endpoint fails in well under a second
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setitem(
        fsspec.config.conf,
        "s3",
        {
            "config_kwargs": {
                "retries": {"max_attempts": 1, "mode": "standard"},
                "connect_timeout": 2,
                "read_timeout": 5,
            }
        },
    )

    def down() -> None:
        proxy.failing = True

    def up() -> None:
        proxy.failing = False

    yield down, up
    proxy.close()


@pytest.mark.parametrize("fmt, cleanup", [("safetensors", "gc"), ("zarr", "next-save")])
def test_s3_failing_mid_save_commits_nothing_and_is_cleaned(flaky_s3, moeckpt_cli, fmt, cleanup):
    down, up = flaky_s3
    run = f"s3://flaky/run-{fmt}-{cleanup}"
    location = f"{run}/{step_dir_name(10)}"
    layout = Layout(tp=2, ep=2, dp=2)
    tensors, by_writer = _pieces_by_writer(layout)
    written = []

    def after_writer(nbytes: int) -> None:
        written.append(nbytes)
        if len(written) == 2:
            down()  # S3 starts resetting connections after two of the eight writers are done

    with pytest.raises(errors.StorageError) as failure:
        save_pieces(location, _index(tensors, layout, fmt), by_writer, workers=1, on_written=after_writer)
    assert "\n" not in str(failure.value) and "flaky" in str(failure.value)
    up()
    leftovers = list_objects(location)
    assert leftovers and "moeckpt.json" not in leftovers  # data of the first writers, never an index
    with pytest.raises(errors.NotCommittedError):
        CheckpointReader(location)
    with pytest.raises(errors.NotCommittedError):
        CheckpointReader(run)

    if cleanup == "gc":
        code, out, err = moeckpt_cli("gc", run)
        assert code == 0 and "uncommitted" in out, out + err
        assert list_objects(location) == []
    # the next save to the same prefix, in another layout, holds exactly its own objects: no stale chunk of the
    # failed save survives to be mistaken for data by a plain zarr reader
    small = Layout(tp=1, ep=1, dp=2)
    tensors, by_writer = _pieces_by_writer(small)
    index = save_pieces(location, _index(tensors, small, fmt), by_writer, overwrite=cleanup == "next-save")
    objects = set(list_objects(location))
    expected = {"moeckpt.json", *index.files}
    if fmt == "zarr":
        expected |= {r.file for r in CheckpointReader(location).pieces()}
    assert objects == expected
    reader = CheckpointReader(run)
    assert verify(reader) == []
    values = toy_values()
    for name, entry in tensors.items():
        assert tensors_equal(reader.read_tensor(name), values(entry)), name


def test_cli_on_unreachable_s3_is_one_line_and_exit_2(flaky_s3, moeckpt_cli):
    down, up = flaky_s3
    down()
    code, out, err = moeckpt_cli("init", "s3://flaky/unreachable", "--model", "qwen3moe-tiny", "--format", "zarr")
    up()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "s3://flaky/unreachable" in err and "tries" in err, err


def test_s3_save_and_reads_of_both_formats_and_plain_zarr(s3_url, moto_endpoint, monkeypatch):
    monkeypatch.setattr(url_mod, "JOIN_LIMIT_BYTES", 64)  # the larger zarr objects take the spooled upload
    for fmt in ("safetensors", "zarr"):
        loc = f"{s3_url}-{fmt}"
        save_toy(loc, Layout(tp=2, ep=2, dp=2), fmt)
        reader = CheckpointReader(loc)
        assert reader.index.backend == fmt
        assert verify(reader) == []
        entry = reader.index.tensors["exp_avg/moe.experts.gate_up"]
        want = toy_values()(entry)
        assert tensors_equal(reader.read_tensor(entry.name), want)
    import zarr

    arr = zarr.open_array(
        store=f"{s3_url}-zarr",
        path=entry.name,
        mode="r",
        storage_options={"client_kwargs": {"endpoint_url": moto_endpoint}},
    )
    assert arr.attrs["moeckpt"]["dtype"] == entry.dtype == "float32"
    assert tensors_equal(torch.from_numpy(arr[1:3]), want[1:3])


# -- retries, on a real fsspec filesystem that fails the way a network does ---------------------------------


class FlakyFS(MemoryFileSystem):
    """In-memory fsspec filesystem whose next ``failures`` uploads raise the given error."""

    protocol = ("flakymem",)
    root_marker = "/"
    failures = 0
    error: type[BaseException] = ConnectionResetError
    calls = 0

    def pipe_file(self, path, value, **kwargs):
        FlakyFS.calls += 1
        if FlakyFS.failures > 0:
            FlakyFS.failures -= 1
            raise FlakyFS.error(errno.ECONNRESET, "connection reset by peer")
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("flakymem", FlakyFS, clobber=True)


def test_transient_errors_are_retried_with_backoff():
    FlakyFS.failures, FlakyFS.error, FlakyFS.calls = 2, ConnectionResetError, 0
    s = open_storage("flakymem://retry/a", retry=RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05))
    s.write_bytes("x.bin", b"hello")
    assert FlakyFS.calls == 3 and s.read_bytes("x.bin") == b"hello"


def test_transient_errors_give_up_with_one_line():
    FlakyFS.failures, FlakyFS.error, FlakyFS.calls = 10, ConnectionResetError, 0
    s = open_storage("flakymem://retry/b", retry=FAST_RETRY)
    with pytest.raises(errors.StorageError, match="failed after 2 tries") as e:
        s.write_bytes("x.bin", b"hello")
    assert FlakyFS.calls == 2 and "\n" not in str(e.value) and e.value.exit_code == 2


def test_permanent_errors_are_not_retried():
    FlakyFS.failures, FlakyFS.error, FlakyFS.calls = 10, PermissionError, 0
    s = open_storage("flakymem://retry/c", retry=FAST_RETRY)
    with pytest.raises(errors.StorageError, match="permission denied"):
        s.write_bytes("x.bin", b"hello")
    assert FlakyFS.calls == 1
    FlakyFS.failures = 0


def test_read_ranges_fetches_many_ranges_at_once(s3_url):
    s = open_storage(s3_url)
    s.write_bytes("a.bin", bytes(range(256)))
    s.write_bytes("b.bin", bytes(100))
    got = s.read_ranges([("a.bin", 10, 20), ("b.bin", None, None), ("a.bin", 250, 256)])
    assert got == [bytearray(range(10, 20)), bytearray(100), bytearray(range(250, 256))]
    with pytest.raises(FileNotFoundError):
        s.read_ranges([("missing.bin", 0, 1)])


def test_error_classification_of_real_botocore_errors():
    from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

    assert retry_mod.is_transient(client_error("SlowDown", 503))
    assert retry_mod.is_transient(client_error("InternalError", 500))
    assert not retry_mod.is_transient(client_error("NoSuchBucket", 404))
    assert not retry_mod.is_transient(client_error("AccessDenied", 403))
    assert retry_mod.is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert retry_mod.is_transient(ConnectionClosedError(endpoint_url="http://127.0.0.1:1"))
    assert not retry_mod.is_transient(PermissionError("denied"))
    assert not retry_mod.is_transient(FileNotFoundError("gone"))
