"""PostgreSQL's dialect of the database stores' engine."""
