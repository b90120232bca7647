"""The bridge's own entry point: bad arguments are one-line errors before anything starts."""

import subprocess
import sys

from bridge.cli import main as bridge_main


def test_the_cli_rejects_bad_arguments_in_one_line(capsys):
    assert bridge_main(["env", "serve", "chess"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxrl env serve: error: unknown bundled environment 'chess'; known: echo, wordle, guess_number")
    assert bridge_main(["env", "serve", "echo", "--max-concurrent-envs", "0"]) == 2
    assert "--max-concurrent-envs must be at least 1" in capsys.readouterr().err


def test_jaxrl_bridge_hands_its_arguments_to_python_m_bridge(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxrl.run.cli", "bridge", "--engine", "tensorrt", "--model",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "jaxrl bridge: error: unknown engine 'tensorrt'; choose one of: jax, vllm"
