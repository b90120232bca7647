"""The `jaxrl` console script, run as a user would."""

import json
import subprocess
import sys

import yaml


def test_smoke_builds_the_tiny_model_and_generates(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"family": "qwen3", "dir": str(tmp_path / "model"), "seed": 0},
        "smoke": {"prompt": "hello", "max_new_tokens": 5, "temperature": 1.0},
    }))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.cli", "smoke", str(config)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["new_tokens"] == 5 and summary["finish_reason"] == "length"
    assert (tmp_path / "model" / "config.json").exists()
    assert (tmp_path / "model" / "tokenizer.json").exists()
