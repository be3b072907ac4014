"""ComfyUI node definitions: thin V3 schemas that hand their work to carnator_core."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .attention_node import CarnatorSparseAttention
from .calibrate_node import CarnatorCalibrate
from .demo_nodes import CarnatorDemoDecode, CarnatorDemoTextEncode, register_demo
from .host import missing_hooks
from .lookup_node import CarnatorCompatibilityLookup
from .prompt_prefetch import register_prefetch
from .reuse_nodes import CarnatorReport, CarnatorReuse
from .routes import register_routes
from .sampler_nodes import CarnatorKSampler, CarnatorReuseSampler
from .store_nodes import CarnatorStore, CarnatorStoreInfo
from .user_scope import register_scopes

NODE_LIST: list[type[io.ComfyNode]] = [
    CarnatorStore,
    CarnatorStoreInfo,
    CarnatorCompatibilityLookup,
    CarnatorReuse,
    CarnatorReport,
    CarnatorKSampler,
    CarnatorReuseSampler,
    CarnatorSparseAttention,
    CarnatorCalibrate,
    CarnatorDemoTextEncode,
    CarnatorDemoDecode,
]

register_demo()  # the demo weights for UNETLoader, the demo world's oracle for the calibration
missing_hooks()  # says once, at start-up, if this host lacks a hook Carnator needs


# Whose work each prompt is (under --multi-user, the user that posted it); a bad fleet namespace stops the pack here.
register_scopes()
# The store panel's HTTP routes; ComfyUI adds them to its web app after every pack has loaded.
register_routes()
# Queued prompts' texts start embedding when they are queued.
register_prefetch()


class CarnatorExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODE_LIST
