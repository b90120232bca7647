"""The bridge: the actor process hosting generation engines and environment sessions over gRPC."""
