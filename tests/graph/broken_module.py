"""A node module whose import fails (for the loader's tests)."""

raise RuntimeError("this module is broken on purpose")
