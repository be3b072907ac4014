"""The reuse store: entries of earlier requests on a diskcache directory or a Redis database."""
