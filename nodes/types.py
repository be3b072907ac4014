"""Custom socket types that carry Carnator objects between nodes."""

from comfy_api.latest import io

StoreType = io.Custom("CARNATOR_STORE")
MatchType = io.Custom("CARNATOR_MATCH")
