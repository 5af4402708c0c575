"""Before a command touches S3: is the endpoint there at all? One TCP connect, a few seconds at most.

Without it an unreachable endpoint shows up only after the storage layer's retries of every request, and the
message is about the first request, not the endpoint. A proxy in the environment may reach what we cannot, so
then the check is skipped.
"""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlsplit

from moeckpt.formats.errors import StorageError

__all__ = ["CONNECT_TIMEOUT_S", "CONNECT_TRIES", "check_s3_reachable"]

#: how long the one connect may take.
CONNECT_TIMEOUT_S = 3.0


def _endpoint() -> tuple[str, str, int]:
    """(what to call it, host, port) of the S3 endpoint the storage layer will use."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        url = os.environ.get(var)
        if url:
            parts = urlsplit(url if "://" in url else f"https://{url}")
            port = parts.port or (80 if parts.scheme == "http" else 443)
            return f"{url} ({var})", parts.hostname or "", port
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    host = f"s3.{region}.amazonaws.com" if region else "s3.amazonaws.com"
    return host, host, 443


#: connects tried within :data:`CONNECT_TIMEOUT_S` before the endpoint counts as unreachable (a reset is often
#: transient).
CONNECT_TRIES = 3


def check_s3_reachable(args: list[str]) -> None:
    """Raise a one-line :class:`StorageError` when ``args`` name an ``s3://`` location whose endpoint does not
    accept a TCP connection in :data:`CONNECT_TRIES` tries within :data:`CONNECT_TIMEOUT_S`."""
    urls = [a for a in args if isinstance(a, str) and a.startswith(("s3://", "s3a://"))]
    if not urls:
        return
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return
    name, host, port = _endpoint()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    error: OSError | None = None
    tries = 0
    while tries < CONNECT_TRIES:
        tries += 1
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            socket.create_connection((host, port), timeout=left).close()
            return
        except OSError as e:
            error = e
            time.sleep(min(0.1 * tries, max(0.0, deadline - time.monotonic())))
    why = (
        f"no answer within {CONNECT_TIMEOUT_S:.0f} s"
        if isinstance(error, TimeoutError) or error is None
        else (error.strerror or type(error).__name__)
    )
    raise StorageError(
        f"{urls[0]}: the S3 endpoint {name} is unreachable after {tries} tries ({why}); check the "
        "address, the network and that the service runs"
    )
