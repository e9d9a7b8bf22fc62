"""What refused feedback is told: the reason in words, and the field of the feedback it is
about (the endpoint's error names that field)."""

from __future__ import annotations


class Refusal(str):
    """Why feedback was refused, in words, and the field of the feedback it is about
    (``field``: ``id``, ``index`` or ``session``): the endpoint's error names that field."""

    field: str

    def __new__(cls, text: str, field: str = "id") -> "Refusal":
        refusal = super().__new__(cls, text)
        refusal.field = field
        return refusal


#: Why feedback is refused once the run's last checkpoint is written (a 503).
STOPPING = "the run is stopping: its last checkpoint is written, so a reward sent now would never be trained"


def already(completion_id: str, index: int | None) -> Refusal:
    """Why feedback for a choice already rewarded is refused (the first reward stands)."""
    if index is None:
        return Refusal(f"completion {completion_id!r} has choices rewarded already; reward the others by index")
    return Refusal(f"choice {index} of completion {completion_id!r} is already rewarded", "index")
