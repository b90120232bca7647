"""XLA_FLAGS of this test session (conftest) and of the processes its tests start with a device count
of their own."""

# LLVM at its lowest optimization level: the suite compiles thousands of programs and runs each a few
# times, and their compiles were its largest CPU cost after imports. XLA's own passes still run: the
# programs compute what a run's do. Benchmarks, not tests, time the programs a run compiles.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """`devices` virtual CPU devices, compiled as this session compiles."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
