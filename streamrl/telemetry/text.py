"""Text from outside streamrl (a user's reward or agent, a model's output, a client's request)
made fit for a line of a log, the console or a record: printable, on one line, of bounded size.

It sits below every layer that shows such text (rewards, agents, learners, serve), so each can
clean it where the text is made, without importing a layer above its own.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with what is not printable (a newline, an escape sequence) written as its escape:
    a client's path or model name in a log line cannot start a line of its own or move the
    terminal's cursor."""
    return text if text.isprintable() else "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def one_line(text: str, limit: int = 500) -> str:
    """``text`` :func:`printable` (so on one line) and cut to at most ``limit`` characters, the
    cut marked with "…"."""
    # (cut before and after: the escapes of what is not printable make the text longer)
    text = printable(text[:limit + 1])
    return text if len(text) <= limit else text[:limit - 1] + "…"


def message_line(exc: BaseException, limit: int = 300) -> str:
    """``exc``'s message as :func:`one_line`, its runs of whitespace (a library's message over
    several lines) one space each. An exception whose ``str()`` itself raises reads as nothing:
    said inside an ``except``, that ``str()`` would otherwise raise from there."""
    try:
        message = str(exc)
    except KeyboardInterrupt:
        raise
    except BaseException:  # (a __str__ that calls sys.exit(): said inside an except, it would escape it)
        message = ""
    return one_line(" ".join(message.split()), limit)


def error_line(exc: BaseException, limit: int = 500, first_line: bool = False) -> str:
    """``"<type>: <message>"`` of ``exc`` as :func:`one_line` (``first_line``: of its message's
    first line only). An exception whose ``str()`` itself raises reads as its type and nothing more."""
    try:
        message = str(exc)
    except KeyboardInterrupt:
        raise
    except BaseException:  # (a user's exception class with a broken __str__, one that exits: its name still says something)
        message = ""
    if first_line:
        message = message.splitlines()[0] if message.strip() else ""
    return one_line(f"{type(exc).__name__}: {message}", limit)
