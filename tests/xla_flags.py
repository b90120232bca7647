"""XLA_FLAGS of this test session (conftest) and of the processes its tests start with a device count
of their own."""

# The suite compiles thousands of programs and runs each a few times, and their compiles were its largest
# CPU cost after imports: LLVM at its lowest optimization level without its expensive passes, fusions
# emitted by XLA:CPU's older LLVM emitters rather than its MLIR fusion emitters (a third less compile
# CPU for the same tests, docs/benchmarks.md), and each module's code generated on one thread (the
# suite keeps both cores busy already). XLA's own passes still run: the programs compute what a run's
# do. Benchmarks, not tests, time the programs a run compiles.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")


def xla_flags(devices: int) -> str:
    """`devices` virtual CPU devices, compiled as this session compiles."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
