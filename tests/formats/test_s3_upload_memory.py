"""S3 uploads keep memory bounded: multipart parts of a set size with a set number in flight, no double spooling.

s3fs's defaults (50 MiB parts, 10 in flight per upload, files under 100 MiB read whole for one PUT) made a
reshard to S3 hold more than twice the memory of the same reshard to local disk (docs/zarr.md, Storage). These
tests watch the S3 requests that s3fs sends to the moto server (a spy on ``S3FileSystem._call_s3``).
"""

from __future__ import annotations

import sys
import tempfile

import boto3
import pytest
import torch

from moeckpt.formats import errors
from moeckpt.formats.backends import safetensors as st
from moeckpt.formats.box import Box
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.pieces import Piece, tensor_bytes
from moeckpt.formats.storages import open_storage
from moeckpt.formats.storages import s3 as storage_mod
from moeckpt.formats.storages.retry import RetryPolicy

from ..s3_fixtures import BUCKET

MiB = 2**20
#: S3's smallest part (moto enforces it too): the tests shrink S3_PART_BYTES to this to go multipart with little data.
MIN_PART = 5 * MiB


class S3Spy:
    """Records the S3 requests of one s3fs filesystem: (method, key, body size), and upload_part calls in flight."""

    def __init__(self, fs, monkeypatch, fail_complete: int = 0):
        self.calls: list[tuple[str, str | None, int | None]] = []
        self.in_flight = self.max_in_flight = 0
        self.fail_complete = fail_complete
        call = fs._call_s3

        async def spy(method, *args, **kwargs):
            body = kwargs.get("Body")
            self.calls.append((method, kwargs.get("Key"), None if body is None else len(body)))
            if method == "complete_multipart_upload" and self.fail_complete > 0:
                self.fail_complete -= 1
                raise ConnectionResetError(104, "connection reset by peer")  # transient: moeckpt retries
            self.in_flight += method == "upload_part"
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await call(method, *args, **kwargs)
            finally:
                self.in_flight -= method == "upload_part"

        monkeypatch.setattr(fs, "_call_s3", spy)

    def sizes(self, method: str) -> list[int | None]:
        return [n for m, _, n in self.calls if m == method]

    def count(self, method: str) -> int:
        return sum(m == method for m, _, _ in self.calls)


def _payload(n: int, seed: int = 0) -> bytes:
    return (
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    )


def test_defaults_are_explicit_and_bounded():
    assert storage_mod.S3_PART_BYTES == 16 * MiB and storage_mod.S3_UPLOAD_CONCURRENCY == 4
    assert storage_mod.S3_PART_BYTES >= MIN_PART
    assert storage_mod.s3_part_bytes(1) == storage_mod.s3_part_bytes(10_000 * 16 * MiB) == 16 * MiB
    big = 200 * 2**30  # more than 10,000 parts of 16 MiB: parts grow so that the upload stays within S3's limit
    assert storage_mod.s3_part_bytes(big) * 10_000 >= big
    assert open_storage("s3://b/x").seekable_writes and open_storage("/tmp/x").seekable_writes
    assert not open_storage("memory://b/x").seekable_writes


def test_put_file_gets_the_part_size_and_concurrency(s3_url, monkeypatch):
    s = open_storage(s3_url)
    seen = []
    put_file = s.fs.put_file
    monkeypatch.setattr(s.fs, "put_file", lambda *a, **kw: (seen.append(kw), put_file(*a, **kw))[1])
    with s.open_write("small.bin") as f:
        f.write(b"x" * 1000)
    assert seen == [{"chunksize": 16 * MiB, "max_concurrency": 4}]


def test_large_upload_is_multipart_with_bounded_parts_and_round_trips(s3_url, monkeypatch):
    monkeypatch.setattr(storage_mod, "S3_PART_BYTES", MIN_PART)
    s = open_storage(s3_url)
    spy = S3Spy(s.fs, monkeypatch)
    data = _payload(5 * MIN_PART + 12345)  # 6 parts: one batch of 4 in flight, then 2
    with s.open_write("big.bin") as f:
        f.write(data)
    assert spy.count("put_object") == 0 and spy.count("create_multipart_upload") == 1
    assert spy.sizes("upload_part") == [MIN_PART] * 5 + [12345]
    assert spy.max_in_flight == storage_mod.S3_UPLOAD_CONCURRENCY
    assert spy.count("complete_multipart_upload") == 1
    assert s.read_bytes("big.bin") == data


def test_retried_multipart_upload_is_whole_and_leaves_no_upload_behind(s3_url, moto_endpoint, monkeypatch):
    monkeypatch.setattr(storage_mod, "S3_PART_BYTES", MIN_PART)
    s = open_storage(s3_url, retry=RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.05))
    spy = S3Spy(s.fs, monkeypatch, fail_complete=1)
    data = _payload(2 * MIN_PART + 7, seed=1)
    with s.open_write("retried.bin") as f:
        f.write(data)
    assert spy.count("create_multipart_upload") == 2  # the failed upload was aborted and redone from the spool
    assert spy.count("abort_multipart_upload") == 1
    assert spy.sizes("upload_part") == [MIN_PART, MIN_PART, 7] * 2
    assert s.read_bytes("retried.bin") == data
    key = s._fspath("retried.bin").split("/", 1)[1]
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads")


def test_joined_objects_go_up_in_one_put_without_part_copies(s3_url, monkeypatch):
    # write_parts joins objects up to JOIN_LIMIT_BYTES: pipe_file must send that buffer as it is, not slice it
    # into part copies (it would with its default 50 MiB parts once the object reaches 100 MiB).
    monkeypatch.setattr(storage_mod, "S3_PART_BYTES", MIN_PART)
    s = open_storage(s3_url)
    spy = S3Spy(s.fs, monkeypatch)
    parts = [_payload(3 * MIN_PART, seed=2), b"tail"]
    s.write_parts("joined.bin", parts)
    assert spy.sizes("put_object") == [3 * MIN_PART + 4] and spy.count("upload_part") == 0
    assert s.read_bytes("joined.bin") == b"".join(parts)


# -- the streamed safetensors writer ------------------------------------------------------------------------


def _stream_input():
    """Pieces of a file of a bit over 2 parts of MIN_PART, the big one arriving in slabs, as the resharder sends."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "big": TensorEntry(
            name="big", shape=(3 * MIN_PART // 4 // 1024, 1024), dtype="float32", role="param", param="big"
        ),
        "small": TensorEntry(name="small", shape=(7, 5), dtype="bfloat16", role="param", param="small"),
    }
    pieces = [
        Piece("small", Box((0, 0), (7, 5)), torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        Piece("big", Box((0, 0), tensors["big"].shape), torch.randn(tensors["big"].shape, generator=g)),
    ]
    layout = [(p.tensor, p.box) for p in pieces]

    def chunks():
        for pos, p in enumerate(pieces):
            for slab in p.data.split(1000):
                yield pos, memoryview(tensor_bytes(slab.contiguous()))

    return layout, tensors, pieces, chunks


def _count_calls(monkeypatch, module, name: str) -> list[int]:
    """Counts the calls of ``module.name`` made by moeckpt (the in-process moto server spools request bodies too)."""
    calls = [0]
    real = getattr(module, name)

    def counting(*a, **kw):
        calls[0] += sys._getframe(1).f_globals.get("__name__", "").startswith("moeckpt.")
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("where", ["local", "s3", "memory"])
def test_streamed_file_spools_once_and_is_byte_identical(where, s3_url, tmp_path, monkeypatch):
    monkeypatch.setattr(storage_mod, "S3_PART_BYTES", MIN_PART)
    layout, tensors, pieces, chunks = _stream_input()
    head, buffers = st.encode(pieces, tensors)
    want = head + b"".join(bytes(b) for b in buffers)
    location = {"local": str(tmp_path / "ckpt"), "s3": s3_url, "memory": f"memory://moeckpt-tests/{tmp_path.name}"}
    s = open_storage(location[where])
    spooled = _count_calls(monkeypatch, tempfile, "TemporaryFile")
    named = _count_calls(monkeypatch, tempfile, "NamedTemporaryFile")
    spy = S3Spy(s.fs, monkeypatch) if where == "s3" else None

    entry = st.write_file_stream(s, "rank-00000.safetensors", layout, tensors, chunks())

    # S3 and local disk write straight into open_write's (seekable) file; only a write-once stream is spooled first.
    assert spooled[0] == (1 if where == "memory" else 0)
    assert named[0] == (1 if where == "s3" else 0)  # S3: open_write's own spool, the only one
    assert s.read_bytes("rank-00000.safetensors") == want
    assert entry.size == len(want)
    if spy is not None:
        assert spy.count("create_multipart_upload") == 1 and spy.count("put_object") == 0
        assert max(spy.sizes("upload_part")) == MIN_PART
    if where == "memory":
        s.remove()


def test_failed_source_uploads_nothing(s3_url, monkeypatch):
    layout, tensors, _, chunks = _stream_input()
    s = open_storage(s3_url)
    spy = S3Spy(s.fs, monkeypatch)

    def failing():
        for i, item in enumerate(chunks()):
            if i == 3:
                raise errors.DataFileError("source piece is corrupt")
            yield item

    with pytest.raises(errors.DataFileError, match="source piece is corrupt"):
        st.write_file_stream(s, "rank-00000.safetensors", layout, tensors, failing())
    assert not any(m in ("put_object", "create_multipart_upload") for m, _, _ in spy.calls)
    assert not s.exists("rank-00000.safetensors")
