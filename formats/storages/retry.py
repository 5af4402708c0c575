"""Retries of remote operations: which errors are transient, and how long to wait between tries."""

from __future__ import annotations

import errno
import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How remote operations are retried when the error is transient."""

    #: tries in all, the first included.
    attempts: int = 5
    #: the delay before the second try; it doubles on each further try (with jitter), up to ``max_delay_s``.
    base_delay_s: float = 0.25
    #: the longest delay between two tries.
    max_delay_s: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError("RetryPolicy needs 0 <= base_delay_s <= max_delay_s")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (0-based)."""
        d = min(self.max_delay_s, self.base_delay_s * (2**attempt))
        return d * (0.5 + random.random() / 2)  # jitter: many ranks retrying must not hit the store in lockstep


#: the policy every remote storage uses unless given another (tests shorten it); read at each operation.
DEFAULT_RETRY = RetryPolicy()

#: S3 error codes that a later try may not see (throttling, server-side trouble).
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "500",
        "502",
        "503",
        "504",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        getattr(errno, "EREMOTEIO", errno.EIO),
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EAGAIN,
        errno.EBUSY,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
    }
)
#: botocore/aiohttp connection and timeout errors are not OSErrors; they are matched by class name, so that this
#: module imports neither (both only exist when s3fs is in use).
_TRANSIENT_CLASSES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "HTTPClientError",
        "IncompleteRead",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ClientConnectionError",
        "ClientOSError",
        "ResponseParserError",
        "FSTimeoutError",
    }
)


def is_transient(e: BaseException) -> bool:
    """Whether a failed remote operation is worth another try (network trouble, throttling, 5xx)."""
    if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    response = getattr(e, "response", None)  # botocore ClientError: the S3 error code and HTTP status
    if isinstance(response, dict):
        err = response.get("Error", {}) or {}
        status = str((response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode", ""))
        return str(err.get("Code", "")) in _TRANSIENT_CODES or status.startswith("5")
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    return bool({c.__name__ for c in type(e).__mro__} & _TRANSIENT_CLASSES)
