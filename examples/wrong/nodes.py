"""Node classes for the wrong examples that need one (written against the public API, as a user would).

`HiddenReference` passes its hidden states downstream in its compute dtype, and says so with
`compute_dtype_outputs`: the only kind of edge on which `flowrl check` compares dtypes.
"""

from flowrl.nodes.reference import Reference


class HiddenReference(Reference):
    """A reference that also sends its last hidden states (in its compute dtype) downstream."""

    compute_dtype_outputs = ("out",)
