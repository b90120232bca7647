"""The run layer: the `jaxrl` command line, configs, the train loop, evaluation, the warm start,
process launchers, tracking, reports, sweeps and export. It composes the learner core (`jaxrl`)
and the bridge, which it reaches only through the bridge's public contract: `bridge.client`,
`bridge.wire` and `bridge.envs.spec` (and `python -m bridge` as a process). Nothing in the core
or the bridge imports it (tests/test_layers.py)."""
