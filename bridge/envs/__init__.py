"""OpenEnv environments: sessions over the WebSocket transport and the bundled environments."""
