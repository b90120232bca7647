"""The bridge: the actor process hosting generation engines and environment sessions over gRPC.

Its own program (`python -m bridge serve|env`, see `bridge/cli.py`); its public contract for
trainers is `bridge.client`, `bridge.wire` and `bridge.envs.spec`. Of the learner core it uses
only the model, the snapshot reader and its stores, `jaxrl.compilation`, `jaxrl.host_memory` and
`jaxrl.logprobs` (the distillation teacher scores as the learner does), and never imports the run
layer.
"""
