"""Outside text made fit for one line (``telemetry/text.py``)."""

from __future__ import annotations

from streamrl.telemetry.text import error_line, one_line


def test_one_line_escapes_what_is_not_printable_and_cuts_at_the_limit():
    assert one_line("a\nb\x1b[2J", 100) == "a\\nb\\x1b[2J"
    cut = one_line("\n" * 1000, 50)
    assert len(cut) == 50 and cut.endswith("…") and cut.isprintable()


def test_an_exception_whose_str_raises_is_named_by_its_type():
    class Broken(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    assert error_line(Broken()) == "Broken: "
    assert error_line(ValueError("one\ntwo"), first_line=True) == "ValueError: one"
