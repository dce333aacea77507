"""User interfaces: they render what the session manager emits and hold no model logic."""
