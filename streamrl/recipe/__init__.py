"""Recipes: the TOML file, its overrides and phase-one validation (``recipe.py``), its
``[cluster]`` and ``[pools.*]`` tables (``pools.py``), its ``[[learners]]`` tables
(``learners.py``), its ``[serve]`` table (``serve.py``), the base of every recipe model (``strict.py``),
the paths it holds (``paths.py``), and the users' own Python files a recipe names (``user_files.py``)."""
