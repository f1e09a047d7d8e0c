"""uvicorn's HTTP/1.1 protocol with a connection cap and a header read timeout.

uvicorn closes idle keep-alive connections, but a client that connects and then sends its headers
one byte a second holds the socket for ever; and `limit_concurrency` answers 503 only once a whole
request arrived. Here each connection is checked as it is made (over `max_connections`: 503 with
Retry-After, closed at once) and must finish a request's headers within `header_timeout_s` of
connecting or of its previous response (else 408, closed). Body read timeouts are the app's
(`state.parse_body`): the headers are in by then.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.server.errors import RETRY_AFTER_S

logger = logging.getLogger("uvicorn.error")

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %d\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s")
_BUSY_BODY = b'{"error":{"message":"too many open connections","type":"server_error","code":"too_many_connections"}}'
_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """An `H11Protocol` subclass enforcing these limits (pass it as uvicorn's `http=`)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                logger.warning("kvserve: refused a connection: %d open (--max-connections)", len(self.connections) - 1)
                transport.write(_BUSY % (RETRY_AFTER_S, len(_BUSY_BODY), _BUSY_BODY))
                transport.close()
                return
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout, self.cycle)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self, cycle_when_armed: object) -> None:
            """Close the connection if no request's headers completed since the timer was armed."""
            self._header_timer = None
            if self.cycle is not cycle_when_armed or self.transport.is_closing():
                return
            prefix = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
            logger.info("%sclosed: no request headers within %g s", prefix, header_timeout_s)
            self.transport.write(_TIMEOUT)
            self.transport.close()

    return GuardedH11Protocol
