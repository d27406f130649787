"""The base error of flowrl, at the package root so every layer can raise it without importing
another layer."""


class FlowrlError(Exception):
    """Base class of every error flowrl raises for a user's mistake or a failed run."""
