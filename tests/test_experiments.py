"""Experiment scripts use only what is public: no `_private` module or name of ours, and of the
run layer only its documented API (`jaxrl.run.api`). Read from every import, function-level ones
included, of every module under experiments/ (the benchmarks too)."""

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("jaxrl", "bridge", "experiments")
RUN_API = "jaxrl.run.api"


def _imported(path: Path) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) for every import of ours in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out += [(node.module, a.name) for a in node.names]
    return [(m, n) for m, n in out if m.split(".")[0] in OURS]


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "experiments").rglob("*.py")):
        where = path.relative_to(root)
        for module, name in _imported(path):
            full = f"{module}.{name}" if name and module == "jaxrl.run" else module  # `from jaxrl.run import api`
            if any(part.startswith("_") and part != "__future__" for part in module.split(".")) or (
                    name or "").startswith("_"):
                found.append(f"{where} imports a private name: {module}{'.' + name if name else ''}")
            elif (full == "jaxrl.run" or full.startswith("jaxrl.run.")) and full != RUN_API:
                found.append(f"{where} imports {full}: of the run layer, experiments use {RUN_API} only")
    return found


def test_experiments_import_only_public_modules():
    assert violations(ROOT) == []


def test_a_private_import_is_caught(tmp_path):
    shutil.copytree(ROOT / "experiments", tmp_path / "experiments", ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "experiments" / "loss_variants.py"
    script.write_text(script.read_text() + "\n\ndef f():\n    from jaxrl.run.train import train\n"
                      "    from bridge.envs.bundled._base import play\n    from jaxrl.learner import _x\n"
                      "    from jaxrl.run import collection\n")
    assert violations(tmp_path) == [
        "experiments/loss_variants.py imports jaxrl.run.train: of the run layer, experiments use jaxrl.run.api only",
        "experiments/loss_variants.py imports a private name: bridge.envs.bundled._base.play",
        "experiments/loss_variants.py imports a private name: jaxrl.learner._x",
        "experiments/loss_variants.py imports jaxrl.run.collection: of the run layer, experiments use jaxrl.run.api "
        "only",
    ]
