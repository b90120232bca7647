"""OpenEnv environments: sessions over the WebSocket transport and the bundled environments."""

import os
import sys

# openenv.core.env_server imports its Gradio web UI at package import (3-8 s of imports on 2 cores, in
# every bridge and environment server) and carries on without it when the module is missing, as it
# does where Gradio is not installed. We never serve that UI unless OpenEnv's own switch asks for it.
if os.getenv("ENABLE_WEB_INTERFACE", "false").lower() not in ("true", "1", "yes"):
    sys.modules.setdefault("openenv.core.env_server.web_interface", None)
