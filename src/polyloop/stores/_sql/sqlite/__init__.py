"""SQLite's dialect of the database stores' engine."""
