"""Custom socket types that carry Carnator objects between nodes, and schema options the host may lack."""

import inspect

from comfy_api.latest import io

StoreType = io.Custom("CARNATOR_STORE")
MatchType = io.Custom("CARNATOR_MATCH")

_HOST_HAS_ADVANCED_INPUTS = "advanced" in inspect.signature(io.Input.__init__).parameters


def advanced_input() -> dict:
    """Keyword arguments that mark an input as advanced (folded away until asked for) where the host's schema has
    the option; none elsewhere. Only the display changes: a saved workflow's widget values load the same."""
    return {"advanced": True} if _HOST_HAS_ADVANCED_INPUTS else {}
