"""A TCP proxy on loopback that caps throughput, for benchmarks of network-bound storage (issue 32's S3 target).

Put it in front of an S3 server on 127.0.0.1 (moto) and point ``AWS_ENDPOINT_URL_S3`` at the proxy: every byte
of every connection then passes through one token bucket per direction (client to server: "up", server to client:
"down"), shared by all connections, so 16 concurrent uploads together get the cap, as the uploads of one host share
its network link. The proxy counts the bytes it relays in each direction (TCP payload: HTTP headers included).

How the cap is kept: a relay thread that received ``n`` bytes reserves ``n`` tokens (the bucket may go into debt)
and sleeps until the debt its reservation made is paid back at the cap, then sends. Over any interval the bytes
sent are at most ``cap x interval + burst``; a short burst (:data:`BURST_BYTES`) keeps a new connection from
waiting a whole reservation. The proxy adds no other limit: whether the cap is reached depends on the client and
server keeping it busy, which is what a benchmark measures.

Two ways to run it:

* in this process: ``ThrottleProxy(("127.0.0.1", port), up=100e6, down=100e6)`` (threads; used by the tests);
* in its own process, so that relaying takes no interpreter lock from the process measured:
  ``ProxyProcess.start(target, up=..., down=...)``, which runs ``python benchmarks/throttle_proxy.py --target
  HOST:PORT`` and talks to it over its stdin and stdout (one JSON object a line: ``{"up": B, "down": B}`` sets the
  caps, bytes/s or null for none; ``{"stats": true}`` answers the counters; end of input stops it).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

log = logging.getLogger(__name__)

#: bytes one relay thread reads before it reserves tokens and sends them on.
CHUNK_BYTES = 128 * 1024
#: tokens a bucket holds when idle: what may pass at once before the cap applies.
BURST_BYTES = 4 * CHUNK_BYTES


class TokenBucket:
    """A byte budget refilled at ``rate`` bytes/s (``None``: no cap), shared by every thread that calls :meth:`take`."""

    def __init__(self, rate: float | None, burst: int = BURST_BYTES) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be positive bytes/s or None, got {rate!r}")
        self._lock = threading.Lock()
        self._rate = rate
        self._burst = burst
        self._tokens = float(burst)
        self._stamp = time.monotonic()

    @property
    def rate(self) -> float | None:
        return self._rate

    def set_rate(self, rate: float | None) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"rate must be positive bytes/s or None, got {rate!r}")
        with self._lock:
            self._refill(time.monotonic())
            self._rate = rate
            if rate is None:  # uncapped: no debt is carried into a later cap
                self._tokens = float(self._burst)

    def _refill(self, now: float) -> None:
        if self._rate is not None:
            self._tokens = min(float(self._burst), self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now

    def take(self, n: int) -> None:
        """Reserve ``n`` bytes, then sleep until the bucket's debt that includes them is paid at the rate."""
        with self._lock:
            if self._rate is None:
                return
            self._refill(time.monotonic())
            self._tokens -= n
            wait = -self._tokens / self._rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class ThrottleProxy:
    """Relays every connection to ``target`` through the up and down buckets, on its own threads."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        up: float | None = None,
        down: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.target = target
        self.up, self.down = TokenBucket(up), TokenBucket(down)
        self._lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self._sock = socket.create_server((host, port))
        self.port = int(self._sock.getsockname()[1])
        self.endpoint = f"http://{host}:{self.port}"
        self._accepting = threading.Thread(target=self._serve, name="throttle-accept", daemon=True)
        self._accepting.start()

    def set_caps(self, up: float | None, down: float | None) -> None:
        self.up.set_rate(up)
        self.down.set_rate(down)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "bytes_up": self.bytes_up,
                "bytes_down": self.bytes_down,
                "connections": self.connections,
                "up": self.up.rate,
                "down": self.down.rate,
            }

    def close(self) -> None:
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._relay, args=(client,), name="throttle-relay", daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.target)
        except OSError as e:
            log.warning("throttle proxy: cannot reach %s:%d: %s", *self.target, e)
            client.close()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=self._pump, args=(server, client, False), name="throttle-down", daemon=True)
        back.start()
        self._pump(client, server, True)
        back.join()
        client.close()
        server.close()

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        bucket = self.up if upward else self.down
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        try:
            while n := src.recv_into(buf):
                bucket.take(n)
                dst.sendall(view[:n])
                with self._lock:
                    if upward:
                        self.bytes_up += n
                    else:
                        self.bytes_down += n
        except OSError:
            pass  # a reset connection ends its relay; the client sees the reset and retries
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass


class ProxyProcess:
    """A :class:`ThrottleProxy` in a process of its own, driven over its stdin and stdout."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc = proc
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, target: tuple[str, int], *, up: float | None = None, down: float | None = None) -> ProxyProcess:
        cmd = [sys.executable, __file__, "--target", f"{target[0]}:{target[1]}"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = _read_line(proc.stdout)
        me = cls(proc, int(first["port"]))
        me.set_caps(up, down)
        return me

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None  # opened with PIPE
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return _read_line(self.proc.stdout)

    def set_caps(self, up: float | None, down: float | None) -> None:
        self._ask({"up": up, "down": down})

    def stats(self) -> dict[str, Any]:
        return self._ask({"stats": True})

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _read_line(stream: IO[str] | None) -> dict[str, Any]:
    line = stream.readline() if stream is not None else ""
    if not line:
        raise RuntimeError("the throttle proxy process ended without answering")
    return json.loads(line)


def main() -> None:
    p = argparse.ArgumentParser(description="A bandwidth-capped TCP proxy (see the module docstring).")
    p.add_argument("--target", required=True, help="HOST:PORT to relay to")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    args = p.parse_args()
    host, port = args.target.rsplit(":", 1)
    proxy = ThrottleProxy((host, int(port)), port=args.port)
    print(json.dumps({"port": proxy.port}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "stats" in request:
            print(json.dumps(proxy.stats()), flush=True)
        else:
            proxy.set_caps(request.get("up"), request.get("down"))
            print(json.dumps({"ok": True}), flush=True)
    proxy.close()


if __name__ == "__main__":
    main()
