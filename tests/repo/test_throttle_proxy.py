"""benchmarks/throttle_proxy.py, the bandwidth cap of the S3 compression benchmark, keeps its cap: several
connections together move bytes at the cap (not above it beyond the burst, not far below it on an idle proxy), in
each direction, in this process and in a process of its own, and it counts every byte it relays."""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "throttle_proxy.py"
_spec = importlib.util.spec_from_file_location("throttle_proxy", _PATH)
assert _spec is not None and _spec.loader is not None
throttle_proxy = importlib.util.module_from_spec(_spec)
sys.modules["throttle_proxy"] = throttle_proxy
_spec.loader.exec_module(throttle_proxy)

MB = 1_000_000


class _Server:
    """A TCP server on loopback: ``sink`` counts what each connection sends; ``source`` sends ``send`` bytes."""

    def __init__(self, send: int = 0) -> None:
        self.send = send
        self.received = 0
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.target = ("127.0.0.1", self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            if self.send:
                conn.sendall(b"\x5a" * self.send)
                conn.shutdown(socket.SHUT_WR)
            while data := conn.recv(1 << 16):
                with self.lock:
                    self.received += len(data)


def _upload(port: int, n: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"\xa5" * n)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the proxy closes once the server has everything


def _download(port: int, got: list[int]) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.shutdown(socket.SHUT_WR)
        n = 0
        while data := s.recv(1 << 16):
            n += len(data)
        got.append(n)


def _check_rate(moved: int, elapsed: float, cap: float) -> None:
    # At most the cap plus the burst; at least half the cap (an idle loopback moves GB/s; the bound is generous
    # for a loaded 2-core machine).
    burst = throttle_proxy.BURST_BYTES
    assert moved <= cap * elapsed * 1.05 + burst, f"{moved / elapsed / MB:.1f} MB/s over the cap {cap / MB:.0f}"
    assert moved >= cap * elapsed * 0.5, f"{moved / elapsed / MB:.1f} MB/s, far below the cap {cap / MB:.0f}"


def test_upload_cap_is_shared_by_connections() -> None:
    server = _Server()
    cap, each, conns = 15 * MB, 2_500_000, 3
    proxy = throttle_proxy.ThrottleProxy(server.target, up=cap)
    try:
        threads = [threading.Thread(target=_upload, args=(proxy.port, each)) for _ in range(conns)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        proxy.close()
    assert server.received == each * conns
    stats = proxy.stats()
    assert stats["bytes_up"] == each * conns and stats["bytes_down"] == 0 and stats["connections"] == conns
    # 7.5 MB at 15 MB/s: 0.5 s less the burst, for the three together (each alone would be allowed the cap)
    assert elapsed >= (each * conns - throttle_proxy.BURST_BYTES) / cap / 1.05
    _check_rate(each * conns, elapsed, cap)


def test_download_cap_in_its_own_process() -> None:
    each, conns, cap = 4 * MB, 2, 10 * MB
    server = _Server(send=each)
    proxy = throttle_proxy.ProxyProcess.start(server.target, up=None, down=cap)
    try:
        got: list[int] = []
        threads = [threading.Thread(target=_download, args=(proxy.port, got)) for _ in range(conns)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        elapsed = time.monotonic() - t0
        stats = proxy.stats()
    finally:
        proxy.close()
    assert got == [each] * conns
    assert stats["bytes_down"] == each * conns and stats["down"] == cap and stats["up"] is None
    _check_rate(each * conns, elapsed, cap)


def test_caps_change_and_lift() -> None:
    bucket = throttle_proxy.TokenBucket(None)
    t0 = time.monotonic()
    bucket.take(100 * MB)  # uncapped: no wait
    assert time.monotonic() - t0 < 0.05
    bucket.set_rate(20 * MB)
    t0 = time.monotonic()
    for _ in range(8):
        bucket.take(1 * MB)
    elapsed = time.monotonic() - t0
    # 8 MB at 20 MB/s, the first burst free: 0.37-0.4 s
    assert (8 * MB - throttle_proxy.BURST_BYTES) / (20 * MB) * 0.95 <= elapsed <= 1.0
