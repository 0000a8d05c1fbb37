"""The database stores: what both dialects share, and each dialect (``sqlite``, ``postgres``)."""
