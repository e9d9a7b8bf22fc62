"""Worker-side training: the policy, its optimizer, micro-batch accumulation, the step, and the
trainer's state files (``trainer_state.py``: saved with ``torch.distributed.checkpoint``, read
without full unpickling)."""
