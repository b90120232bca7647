"""vLLM tests: run in .venv-vllm only (`bash scripts/setup_vllm.sh`), never in the main suite."""

import os
from pathlib import Path

_cache = Path(__file__).resolve().parents[2] / ".cache"
# Must be set before vllm is imported: in-process engine core, quiet logs, compile caches that
# survive between runs (the first generate compiles the sampler).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CACHE_ROOT", str(_cache / "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_cache / "torchinductor"))
