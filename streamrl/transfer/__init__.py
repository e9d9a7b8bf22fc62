"""Weight transports: how new weights get from the trainer to every generate worker."""
