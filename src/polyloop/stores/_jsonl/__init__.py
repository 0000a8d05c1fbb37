"""The JSON-lines store: one append-only file per run."""
