"""Fails on import, like a plugin whose own dependency is missing."""

import a_module_that_is_not_installed  # noqa: F401
