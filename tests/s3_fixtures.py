"""An S3 endpoint for the tests: moto's server mode on 127.0.0.1 with a free port, as s3fs and zarr test themselves.

The server speaks the real S3 protocol over HTTP, so the code under test runs unchanged (s3fs, botocore, our
retries); only ``AWS_ENDPOINT_URL_S3`` and dummy credentials point it there for the test session.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import subprocess
import sys
import threading

import pytest

from .proc_helpers import close_and_wait

BUCKET = "moeckpt-tests"
_counter = itertools.count()

_ENV_DROP = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL")


#: the server's process: moto's ThreadedMotoServer, its port on stdout, serving until its stdin closes (the test
#: session ended, or died). moto's dispatcher lists its own package directory (a listdir and an isdir per service)
#: for every request, under its lock, to learn its services' names: the list is taken once here instead, the same
#: names (docs/benchmarks/ci.md: a third of the S3 tests' time).
_SERVER = """
import logging, sys
import moto.backends
from moto.server import ThreadedMotoServer
services = tuple(moto.backends.list_of_moto_modules())
moto.backends.list_of_moto_modules = lambda: services
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request would flood the output
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


class MotoServer:
    """moto's ``ThreadedMotoServer`` on 127.0.0.1, run in a process of its own: in the tests' process its request
    handling and the client under test took turns on one interpreter lock, every request waiting for the other
    side's turn (docs/architecture.md, "The test suite")."""

    def __init__(self, port: int = 0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.strip().isdigit():
            self._proc.kill()
            raise RuntimeError(f"moto's server did not start (exit {self._proc.wait()}): {line!r}")
        self.endpoint = f"http://127.0.0.1:{int(line)}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        close_and_wait(self._proc)


def make_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)


@pytest.fixture(scope="session")
def moto_endpoint():
    """The endpoint of a moto S3 server that lives for the whole test session, with the bucket ``BUCKET``."""
    server = MotoServer()
    endpoint = server.endpoint
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }
    saved = {k: os.environ.get(k) for k in (*env, *_ENV_DROP)}
    for k in _ENV_DROP:
        os.environ.pop(k, None)
    os.environ.update(env)
    make_bucket(endpoint, BUCKET)
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3_url(moto_endpoint) -> str:
    """A fresh, empty ``s3://`` location for one checkpoint on the moto server."""
    return f"s3://{BUCKET}/{os.getpid()}-{next(_counter)}/ckpt"


class FaultyProxy:
    """A TCP proxy in front of an S3 endpoint that can start resetting every connection, as a dying S3 would.

    ``failing = True``: every new connection is reset at once (clients see connection errors, which botocore,
    s3fs and moeckpt retry, then give up); ``failing = False``: traffic flows again, with the data intact.
    """

    def __init__(self, endpoint: str):
        host, port = endpoint.rsplit("/", 1)[1].split(":")
        self.target = (host, int(port))
        self.failing = False
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self.connections += 1
            if self.failing:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
                conn.close()
                continue
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        client.close()
        upstream.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
