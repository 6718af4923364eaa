"""analyses."""
