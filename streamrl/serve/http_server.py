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
import struct
import threading
import time

try:  # (the kernel's send queue, where a platform says it: Linux; elsewhere the buffer alone)
    import fcntl
    import termios
except ImportError:  # pragma: no cover
    fcntl = termios = None

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
    descriptors (the rest are the worker's comms, files and the engine's), at most 4,096. The
    soft limit is raised to the hard one first, as Dask's scheduler does: the common default of
    1,024 would allow 256, fewer than an agent run's rollouts hold at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
            if target > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
        except (OSError, ValueError):  # (a platform or container that will not): the limit as it is
            pass
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 4))


def _error(status: int, reason: str, message: str, code: str, kind: str = "invalid_request_error",
           retry_after: bool = False) -> bytes:
    # the API's usual error shape, written straight to the socket: the app never saw the request
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            + ("retry-after: 1\r\n" if retry_after else "") + "connection: close\r\n\r\n").encode() + body


def bounded_protocol(head_limit: int = HEAD_LIMIT_BYTES, head_timeout_s: float = HEAD_TIMEOUT_S,
                     connections: int | None = None, write_timeout_s: float = WRITE_TIMEOUT_S):
    """uvicorn's httptools protocol with the bounds of this module's docstring: a head past
    ``head_limit`` bytes is answered 431 and closed (and so is a chunked body whose framing and
    trailers, the bytes that are not its content, pass it); one not done within
    ``head_timeout_s`` is answered 408 and closed; a connection past ``connections`` open ones
    is answered 503 and closed at once; bytes that are not HTTP/1.1 are answered 400 (each of
    these in the API's error shape, not uvicorn's plain text); and one whose client has read nothing of what waits for
    it for ``write_timeout_s`` is cut."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    limit_connections = connections or max_connections()

    class BoundedHead(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            self._message_bytes = self._body_bytes = 0  # (since the request began; of its content)
            self._in_head = True
            self._head_timer = self._write_timer = None
            self._unsent = 0
            super().connection_made(transport)
            if len(self.connections) > limit_connections:  # (this one counted) its descriptor freed now
                transport.write(_error(503, "Service Unavailable", "The endpoint has as many connections open as "
                                       "it keeps; retry shortly.", "too_many_connections", "server_error", True))
                transport.close()
                return
            self._start_head_timer()

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._start_head_timer()
            self._message_bytes += len(data)
            super().data_received(data)
            if self.transport.is_closing():
                return
            # still in the head after all it was sent: the head alone is past the limit (a head
            # and a body that arrive in one read are fine, however large the body)
            if self._in_head and self._message_bytes > head_limit:
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request's line and headers are longer than {head_limit} bytes",
                             "request_header_fields_too_large")
            # and with a chunked body's bytes that are not its content: its chunks' sizes and
            # its trailers, which the parser keeps (a trailer sent for ever, as a header would be)
            elif not self._in_head and self._message_bytes - self._body_bytes > head_limit:
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request's headers, chunk framing and trailers are longer than {head_limit} bytes",
                             "request_header_fields_too_large")

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._stop_head_timer()
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            # the next request on this connection starts its head (its timer with its first byte;
            # until then uvicorn's keep-alive timeout holds the idle connection)
            self._in_head, self._message_bytes, self._body_bytes = True, 0, 0

        def pause_writing(self) -> None:
            # the transport's buffer is full: the client reads slower than the answer comes, or
            # not at all; uvicorn's writer now waits until it drains
            super().pause_writing()
            if self._write_timer is None:
                self._unsent = self._unsent_bytes()
                self._write_timer = self.loop.call_later(write_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _stalled(self) -> None:
            # a client that read some of it meanwhile is slow, not gone: another while. One that
            # read nothing is cut, as a client that went away: uvicorn marks the request
            # disconnected and frees its writer, and the app cancels what it was answering
            unsent = self._unsent_bytes()
            if unsent < self._unsent:
                self._unsent = unsent
                self._write_timer = self.loop.call_later(write_timeout_s, self._stalled)
                return
            self._write_timer = None
            self.transport.abort()

        def _unsent_bytes(self) -> int:
            # what waits to reach the client: the transport's buffer and the kernel's send queue
            # (megabytes of it: a client reading slowly empties that long before the buffer)
            unsent = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            try:
                unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
            except (OSError, AttributeError, ValueError):  # (no such queue here: the buffer alone)
                pass
            return unsent

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

        def send_400_response(self, msg: str) -> None:
            # bytes the parser cannot read as HTTP/1.1 (uvicorn's own answer is a line of plain
            # text): the API's error shape, as every other refusal here
            self._refuse(400, "Bad Request", "The request is not valid HTTP/1.1.", "invalid_http_request")

        def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
            self._stop_head_timer()
            if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
                self.transport.abort()  # (mid-answer to an earlier request: no room for another status)
                return
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
