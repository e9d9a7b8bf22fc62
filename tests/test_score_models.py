"""``streamrl eval``'s table and ``--out`` file (``run/score_models.show_scores``): the scoring
itself is tests/test_eval.py's."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from streamrl.errors import UserError
from streamrl.run.score_models import show_scores


def test_a_models_name_is_shown_as_written_and_the_scores_are_written_first(tmp_path):
    rows = [{"model": "runs/[red]x[/]\x1b[2J", "eval/pass@1": 0.5, "eval/error": "[/bold]boom"}]
    out = io.StringIO()
    show_scores(rows, str(tmp_path / "scores.json"), Console(file=out, width=200))
    text = out.getvalue()
    assert "runs/[red]x[/]\\x1b[2J" in text and "\x1b" not in text and "[/bold]boom" in text
    assert json.loads((tmp_path / "scores.json").read_text()) == rows


def test_scores_that_cannot_be_written_are_one_line_after_the_table(tmp_path):
    out = io.StringIO()
    with pytest.raises(UserError, match="cannot write the scores"):
        show_scores([{"model": "m", "eval/pass@1": 0.5}], str(tmp_path), Console(file=out, width=200))
    assert "0.500" in out.getvalue()  # (the table was printed all the same)


def test_the_file_is_written_even_when_printing_fails(tmp_path):
    class Broken(Console):
        def print(self, *a, **kw):
            raise OSError("the terminal went away")

    with pytest.raises(OSError):
        show_scores([{"model": "m", "eval/pass@1": 0.5}], str(tmp_path / "s.json"), Broken(file=io.StringIO()))
    assert json.loads((tmp_path / "s.json").read_text())[0]["model"] == "m"
