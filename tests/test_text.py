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


def test_an_exception_whose_str_exits_is_named_by_its_type_and_the_exit_contained():
    # (an agent's or a reward's exception class, formatted after its code ran: SystemExit there
    # escaped the except that was reporting it, and ended the worker's task with it)
    import pytest

    from streamrl.agents.rollout import transient_failure
    from streamrl.telemetry.text import message_line

    class Exits(Exception):
        def __str__(self):
            raise SystemExit(2)

        @property
        def code(self):
            raise SystemExit(3)

    assert error_line(Exits()) == "Exits: " and message_line(Exits()) == ""
    assert transient_failure(Exits()) is False

    class Interrupts(Exception):
        def __str__(self):
            raise KeyboardInterrupt  # (the user's Ctrl-C is still theirs)

    with pytest.raises(KeyboardInterrupt):
        error_line(Interrupts())
