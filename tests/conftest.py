"""Test-session setup: 8 virtual CPU devices, so mesh and sharding tests run on one machine."""

import os

# Must happen before jax is first imported anywhere in the session.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
