"""Weight transfers (``[transfer]``): how new weights get from the trainer to every generate worker."""
