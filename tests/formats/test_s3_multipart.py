"""Incomplete S3 multipart uploads (issue 18, item 13): a killed save leaves one, gc aborts it; an interrupted save
(SIGINT, SIGTERM) aborts its own; a successful save leaves none. On the moto server, with a real `moeckpt reshard`
subprocess writing a 105 MB file to S3 (multipart: 5 MiB parts, one in flight, so the upload lasts long enough to
be caught in the middle)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import boto3
import pytest

from moeckpt.formats.checkpoint import CheckpointReader, verify
from moeckpt.formats.retention import RetentionPolicy, apply_gc, plan_gc

from ..helpers import init_qwen_105mb, list_objects
from ..s3_fixtures import BUCKET

pytestmark = pytest.mark.slow

#: the CLI in a subprocess, with S3 parts of 5 MiB (S3's smallest) sent one at a time.
_CLI = """
import sys
from moeckpt.formats.storages import s3
s3.S3_PART_BYTES = 5 * 2**20
s3.S3_UPLOAD_CONCURRENCY = 1
from moeckpt.cli.main import main
sys.argv = ["moeckpt", *sys.argv[1:]]
main()
"""


def _client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _uploads(endpoint: str, prefix: str) -> list[dict]:
    return _client(endpoint).list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []) or []


def _start_reshard(src: str, dst: str):
    return subprocess.Popen(
        [sys.executable, "-c", _CLI, "reshard", src, dst, "--tp", "1", "--ep", "1", "--dp", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def _wait_for_upload_with_parts(endpoint: str, prefix: str, proc, timeout_s: float = 120.0) -> dict:
    """The multipart upload the subprocess is sending, once it has a part stored."""
    client = _client(endpoint)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the reshard ended before its upload was seen: {proc.communicate()}"
        for u in _uploads(endpoint, prefix):
            if client.list_parts(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"]).get("Parts"):
                return u
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("no multipart upload appeared")


@pytest.fixture
def source(tmp_path, moeckpt_cli):
    src, _ = init_qwen_105mb(moeckpt_cli, tmp_path)
    return src


def _key_prefix(url: str) -> str:
    return url.split("/", 3)[3]


def test_a_killed_save_leaves_an_upload_that_gc_aborts(source, s3_url, moto_endpoint, moeckpt_cli):
    run = s3_url
    dst = f"{run}/step-00000100"
    proc = _start_reshard(source, dst)
    upload = _wait_for_upload_with_parts(moto_endpoint, _key_prefix(run), proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert upload["Key"].endswith("step-00000100/rank-00000.safetensors")
    assert _uploads(moto_endpoint, _key_prefix(run)), "a SIGKILL cannot abort anything: the upload is left"

    # A save in flight is younger than the grace age: the default gc leaves its upload alone.
    code, out, err = moeckpt_cli("gc", run)
    assert code == 0, err
    assert "aborted" not in out and _uploads(moto_endpoint, _key_prefix(run))
    code, out, err = moeckpt_cli("gc", run, "--upload-grace", "0", "--dry-run")
    assert code == 0 and "would abort the upload of step-00000100/rank-00000.safetensors" in out, out + err
    assert _uploads(moto_endpoint, _key_prefix(run))
    code, out, err = moeckpt_cli("gc", run, "--upload-grace", "0")
    assert code == 0, err
    assert "aborted the upload of step-00000100/rank-00000.safetensors" in out, out
    assert _uploads(moto_endpoint, _key_prefix(run)) == []
    assert list_objects(dst) == []  # the uncommitted data objects are gone too

    # A successful save of the same step leaves no upload of its own keys behind.
    finished = subprocess.run(
        [sys.executable, "-c", _CLI, "reshard", source, dst, "--dp", "1", "--ep", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stderr
    assert _uploads(moto_endpoint, _key_prefix(run)) == []
    assert verify(CheckpointReader(run)) == []


@pytest.mark.parametrize(
    "sig, code, word",
    [(signal.SIGINT, 130, "moeckpt: interrupted"), (signal.SIGTERM, 143, "moeckpt: stopped by SIGTERM")],
    ids=["SIGINT", "SIGTERM"],
)
def test_an_interrupted_save_aborts_its_own_uploads(source, s3_url, moto_endpoint, sig, code, word):
    dst = f"{s3_url}/step-00000100"
    proc = _start_reshard(source, dst)
    _wait_for_upload_with_parts(moto_endpoint, _key_prefix(s3_url), proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, (out, err)
    assert err.strip().splitlines()[-1] == word, err
    assert "Traceback" not in err, err
    assert _uploads(moto_endpoint, _key_prefix(s3_url)) == [], "the interrupted save left its upload behind"
    # Aborted, not finished first: the interrupted upload never became an object (and nothing was committed).
    assert "rank-00000.safetensors" not in list_objects(dst) and "moeckpt.json" not in list_objects(dst)


def test_trainer_retention_aborts_stale_uploads_only(s3_url, moto_endpoint):
    """The trainer's retention (plan_gc after each commit) aborts uploads idle for longer than the grace age and
    keeps one that received a part since, which may belong to a save in flight."""
    client = _client(moto_endpoint)
    prefix = _key_prefix(s3_url)
    # The young upload's newest part must stay younger than the grace age until the listing has run, on a loaded
    # machine and with S3's times in whole seconds: a grace of 1 s once took it for stale during a full test run.
    grace = 4.0
    uploads = []
    for step in (10, 20):
        key = f"{prefix}/step-000000{step}/rank-00000.safetensors"
        u = client.create_multipart_upload(Bucket=BUCKET, Key=key)
        client.upload_part(Bucket=BUCKET, Key=key, UploadId=u["UploadId"], PartNumber=1, Body=b"part")
        uploads.append(u)
    time.sleep(grace + 0.5)  # both started, and last received a part, longer ago than the grace age
    old, young = uploads
    client.upload_part(Bucket=BUCKET, Key=young["Key"], UploadId=young["UploadId"], PartNumber=2, Body=b"more")
    plan = plan_gc(s3_url, RetentionPolicy(), upload_grace_s=grace)
    assert [u.relpath for u in plan.stale_uploads] == ["step-00000010/rank-00000.safetensors"]
    apply_gc(s3_url, plan)
    left = {u["UploadId"] for u in _uploads(moto_endpoint, prefix)}
    assert left == {young["UploadId"]} and old["UploadId"] not in left
    client.abort_multipart_upload(Bucket=BUCKET, Key=young["Key"], UploadId=young["UploadId"])


def test_gc_refuses_a_hostile_grace(tmp_path, moeckpt_cli):
    for bad in ("-1", "nan", "inf", "soon", ""):
        code, out, err = moeckpt_cli("gc", tmp_path, "--upload-grace", bad)
        assert code == 2 and "--upload-grace" in err and "Traceback" not in err, (bad, err)
