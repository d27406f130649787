"""Built-in nodes, written only against the public flowrl API (as a user's own node would be)."""
