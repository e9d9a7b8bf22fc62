"""An ASGI app served by uvicorn in a thread of this worker process, beside the engine it serves
from: the endpoint (``endpoint.py``) and the token servers of other engines
(``remote_engines.py``) start theirs here.

The server is uvicorn's own (httptools' parser), with bounds on what a client may hold, where
the app's own limits (body size, pending requests) cannot reach. Without them a hostile client
could end the worker the engine runs in, or hold the endpoint's places: a request line or header
sent for ever grows the parser's buffer without limit; a connection that sends half a request
head and stalls is never timed out (uvicorn times out idle keep-alive connections, not slow
heads); each open connection holds a file descriptor the worker's Dask comms and files share;
and a client that stops reading a streamed answer without closing its connection leaves the
answer's writer waiting for ever, its completions counted against ``serve.max_pending``."""

from __future__ import annotations

import json
import resource
import threading
import time

#: The most bytes of one request's line and headers (the body is the app's to bound): 64 KiB,
#: four times the largest head common servers accept by default, far past any OpenAI client's.
HEAD_LIMIT_BYTES = 64 * 1024

#: Seconds an answer's writer may wait on a client that reads none of it (the connection's
#: buffers full) before the connection is cut, as if the client had gone: its request cancelled.
WRITE_TIMEOUT_S = 30.0

#: Seconds a request's line and headers may take from their first byte (or from the connection's
#: start) to their end; a client slower than this is cut off.
HEAD_TIMEOUT_S = 30.0


def max_connections() -> int:
    """The most connections a server keeps open at once: a quarter of this process's file
    descriptors (the rest are the worker's comms, files and the engine's), at most 4,096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 4))


def _error(status: int, reason: str, message: str, code: str) -> bytes:
    # the API's usual error shape, written straight to the socket: the app never saw the request
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def bounded_protocol(head_limit: int = HEAD_LIMIT_BYTES, head_timeout_s: float = HEAD_TIMEOUT_S,
                     connections: int | None = None, write_timeout_s: float = WRITE_TIMEOUT_S):
    """uvicorn's httptools protocol with the bounds of this module's docstring: a head past
    ``head_limit`` bytes is answered 431 and closed, one not done within ``head_timeout_s`` is
    answered 408 and closed, a connection past ``connections`` open ones is closed at once, and
    one whose client has read nothing of what waits for it for ``write_timeout_s`` is cut."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    limit_connections = connections or max_connections()

    class BoundedHead(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            self._head_bytes = 0
            self._in_head = True
            self._head_timer = self._write_timer = None
            super().connection_made(transport)
            if len(self.connections) > limit_connections:  # (this one counted) its descriptor freed now
                transport.abort()
                return
            self._start_head_timer()

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            # the transport's buffer is full: the client reads slower than the answer comes, or
            # not at all; uvicorn's writer now waits until it drains
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _stalled(self) -> None:
            # as a client that went away: uvicorn marks the request disconnected and frees its
            # writer, and the app's disconnect handling cancels what it was answering
            self._write_timer = None
            self.transport.abort()

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._start_head_timer()
                self._head_bytes += len(data)
            super().data_received(data)
            # still in the head after all it was sent: the head alone is past the limit (a head
            # and a body that arrive in one read are fine, however large the body)
            if self._in_head and self._head_bytes > head_limit and not self.transport.is_closing():
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request's line and headers are longer than {head_limit} bytes",
                             "request_header_fields_too_large")

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._stop_head_timer()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            # the next request on this connection starts its head (its timer with its first byte;
            # until then uvicorn's keep-alive timeout holds the idle connection)
            self._in_head, self._head_bytes = True, 0

        def _start_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_too_slow)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self._refuse(408, "Request Timeout", f"the request's line and headers took longer than "
                             f"{head_timeout_s:g} s", "request_timeout")

        def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
            self._stop_head_timer()
            self.transport.write(_error(status, reason, message, code))
            self.transport.close()

    return BoundedHead


def start_in_thread(app, host: str, port: int, name: str, timeout_s: float = 30.0, protocol=None):
    """Serve ``app`` at ``host:port`` (0: a free port) from a daemon thread named ``name``;
    ``(server, thread, the port it listens on)``, or None when it could not listen within
    ``timeout_s`` (the port in use, an address not of this host). No lifespan events, no access
    log: the app holds no state that needs them, and requests are counted, not printed.
    ``protocol``: the HTTP protocol class (default :func:`bounded_protocol`'s)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           lifespan="off", http=protocol or bounded_protocol()))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.time() + timeout_s
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.02)
    if not server.started:
        server.should_exit = True
        return None
    return server, thread, server.servers[0].sockets[0].getsockname()[1]
