"""PolyLoop."""
