"""MkDocs hooks (mkdocs.yml `hooks:`): the page of every config key is generated at each build from
jaxrl's typed config, as `jaxrl config --markdown` prints it, so it cannot go stale.

The docs environment (.venv-docs, scripts/docs.sh) holds MkDocs and nothing of jaxrl's: the page is
printed by jaxrl's own environment, `$JAXRL_PYTHON` or else `.venv/bin/python` (scripts/setup.sh).
"""

import os
import subprocess
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
PAGE = "reference/config.md"
INTRO = """# Every config key

Generated from the typed config (`jaxrl/run/config.py`) at each build of this site, as
`jaxrl config --markdown` prints it; `jaxrl config` prints the same keys as commented YAML, and
`jaxrl config FILE` checks a config and prints it resolved. A config file sets only what differs from
these defaults; `--set dotted.key=value` overrides one key on the command line (see
[Configuration](../configuration.md)). Keys of a list's items read `envs[].name`: `envs: [{name: ...}]`.

"""


def on_files(files, config):
    python = os.environ.get("JAXRL_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).is_file():
        raise PluginError(f"docs: {python} does not exist; the config page is printed by jaxrl's environment: "
                          "run `bash scripts/setup.sh` first, or set JAXRL_PYTHON to a Python that imports jaxrl")
    # From the repository root, so that this tree's jaxrl is the one imported.
    done = subprocess.run([python, "-m", "jaxrl.run.cli", "config", "--markdown"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if done.returncode != 0 or not done.stdout.strip():
        raise PluginError(f"docs: `jaxrl config --markdown` failed ({done.returncode}):\n{done.stderr[-2000:]}")
    files.append(File.generated(config, PAGE, content=INTRO + done.stdout))
    return files
