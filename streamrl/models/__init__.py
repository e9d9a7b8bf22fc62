"""Model folders a recipe points at: ``streamrl model init`` (``initialize.py``: a task's tiny
model and tokenizer, warm-started)."""
