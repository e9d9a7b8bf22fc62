"""Plugins: the hooks (``hookspecs.py``), the plugin manager and registry (``registry.py``), the
built-in components, registered through the same hooks (``builtins.py``), and a recipe's
component names resolved to plugins, their sections validated (``resolve.py``: phase two of
validation)."""
