"""Room for request bodies while the endpoint reads, parses and tokenizes them.

Completions count against ``serve.max_pending`` only once their prompt is tokenized. Before that
a request's body is read, parsed and queued for the one tokenizing thread; without a bound
there, clients could queue bodies without end, each held parsed meanwhile. So the bodies in
those stages may together hold at most ``ADMISSION_BODIES`` largest bodies' worth of bytes,
charged as they arrive (a client that declares megabytes and sends a trickle holds a trickle);
past that a request is answered 429.
"""

from __future__ import annotations

import contextlib

from streamrl.serve.request_bodies import busy

#: How many largest request bodies (``serve.max_body_bytes``) may be read, parsed and tokenized
#: at once: 16 x 4 MiB by default. Small requests, the usual ones, are thousands at once under it.
ADMISSION_BODIES = 16

#: The largest ``POST /v1/feedback`` body: an id, a session, an index and a number.
FEEDBACK_BODY_BYTES = 4096


@contextlib.contextmanager
def admitted(endpoint):
    """Within: a request's :class:`Admission` on ``endpoint`` (an ``openai_api.Endpoint``: its
    ``admitted_bytes``, ``admission_budget`` and ``traffic``); its bytes are given back at the
    end, however the request ends."""
    room = Admission(endpoint)
    try:
        yield room
    finally:
        endpoint.admitted_bytes -= room.taken


class Admission:
    """One request's share of the endpoint's ``admitted_bytes``: the bytes of its body received
    so far. Charged as they come, not as declared, so a client that declares megabytes and
    sends a trickle holds only the trickle."""

    def __init__(self, endpoint):
        self.endpoint, self.taken = endpoint, 0

    def take(self, size: int) -> None:
        """``size`` more bytes of the body; a 429 past the budget, unless this request is the
        only one holding any (a body the endpoint takes at all is never refused for itself)."""
        e = self.endpoint
        if e.admitted_bytes > self.taken and e.admitted_bytes + size > e.admission_budget:
            raise busy(e.traffic, f"{e.admitted_bytes} bytes of requests are being read or tokenized")
        e.admitted_bytes += size
        self.taken += size
