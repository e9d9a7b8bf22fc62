"""A streamrl page on the Dask dashboard. Being written; see install and publish."""

from __future__ import annotations


def install(client) -> str | None:
    """Make the page available on the scheduler's dashboard; returns its URL (None if it cannot)."""
    return None


def publish(client, record: dict) -> None:
    """Send one step's record to the page."""
