"""Inference engines: held on generate workers, they turn prompt groups into samples."""
