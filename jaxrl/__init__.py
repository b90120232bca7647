"""jaxrl: reinforcement learning of language models in JAX, with rollouts from a bridge process."""
