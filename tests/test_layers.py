"""The three layers and their one-way arrows, read from every module's imports (function-level
imports included):

    learner core (jaxrl, not jaxrl.run)  imports neither the bridge nor the run layer;
    bridge (bridge)                      imports of the core only the model, snapshots, the compile
                                         cache/count and the malloc settings (the JAX engine's needs),
                                         never the run layer;
    run layer (jaxrl.run)                imports of the bridge only its public contract.
"""

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# jaxrl.logprobs: a distillation teacher scores the student's tokens as the learner does.
BRIDGE_MAY_USE_OF_CORE = ("jaxrl.models", "jaxrl.snapshots", "jaxrl.snapshot_store", "jaxrl.compilation",
                          "jaxrl.host_memory", "jaxrl.logprobs")
RUN_MAY_USE_OF_BRIDGE = ("bridge.client", "bridge.wire", "bridge.envs.spec")
PACKAGES = ("jaxrl", "jaxrl.run", "bridge", "bridge.envs", "bridge.engines")


def _layer(module: str) -> str | None:
    if module == "jaxrl.run" or module.startswith("jaxrl.run."):
        return "run"
    if module == "jaxrl" or module.startswith("jaxrl."):
        return "core"
    if module == "bridge" or module.startswith("bridge."):
        return "bridge"
    return None


def _within(module: str, allowed: tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def _imports(path: Path, module: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                names.append(".".join(base + ([node.module] if node.module else [])))
            elif node.module in PACKAGES:  # `from jaxrl.run import report` imports jaxrl.run.report
                names += [f"{node.module}.{a.name}" for a in node.names]
            else:
                names.append(node.module)
    return names


def violations(root: Path) -> list[str]:
    found = []
    for package in ("jaxrl", "bridge"):
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            layer = _layer(module)
            for name in _imports(path, module):
                target = _layer(name)
                if target is None or target == layer:
                    continue
                if layer == "core":
                    found.append(f"{module} (learner core) imports {name} ({target} layer)")
                elif layer == "bridge" and (target == "run" or not _within(name, BRIDGE_MAY_USE_OF_CORE)):
                    found.append(f"{module} (bridge) imports {name}")
                elif layer == "run" and target == "bridge" and not _within(name, RUN_MAY_USE_OF_BRIDGE):
                    found.append(f"{module} (run layer) imports bridge internals: {name}")
    return found


def test_the_layers_import_one_way():
    assert violations(ROOT) == []


def _copy_tree(tmp_path: Path) -> Path:
    for package in ("jaxrl", "bridge"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_an_arrow_added_backwards_is_caught(tmp_path):
    root = _copy_tree(tmp_path)
    losses = root / "jaxrl" / "losses.py"
    losses.write_text(losses.read_text() + "\n\ndef _f():\n    from jaxrl.run.config import TrainConfig\n")
    engine = root / "bridge" / "engines" / "base.py"
    engine.write_text(engine.read_text() + "\nfrom jaxrl import train_step\n")
    collection = root / "jaxrl" / "run" / "collection.py"
    collection.write_text(collection.read_text() + "\nfrom bridge.envs.session import SessionConfig\n")
    found = violations(root)
    assert any("jaxrl.losses (learner core) imports jaxrl.run.config" in v for v in found)
    assert any("bridge.engines.base (bridge) imports jaxrl.train_step" in v for v in found)
    assert any("jaxrl.run.collection (run layer) imports bridge internals: bridge.envs.session" in v for v in found)
    assert len(found) == 3
