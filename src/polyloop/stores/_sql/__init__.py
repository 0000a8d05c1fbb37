"""The database stores: one engine (``engine``) and its dialects (``sqlite``, ``postgres``)."""
