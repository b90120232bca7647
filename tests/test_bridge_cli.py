"""The bridge's own entry point: bad arguments are one-line errors before anything starts; a real
`python -m bridge serve` over TLS refuses every call without its token."""

import datetime
import ipaddress
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bridge.cli import main as bridge_main
from bridge.client import BridgeClient, BridgeUnauthenticated, BridgeUnavailable
from bridge.engines.base import SamplingParams
from bridge.wire import BRIDGE_LISTENING, TOKEN_ENV
from jaxrl.tiny import build_tiny_model
from processes import error_line
from xla_flags import xla_flags

ROOT = Path(__file__).parents[1]


def test_the_cli_rejects_bad_arguments_in_one_line(capsys, tmp_path, monkeypatch):
    assert bridge_main(["env", "serve", "chess"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxrl env serve: error: unknown bundled environment 'chess'; known: echo, wordle, guess_number")
    assert bridge_main(["env", "serve", "echo", "--max-concurrent-envs", "0"]) == 2
    assert "--max-concurrent-envs must be at least 1" in capsys.readouterr().err
    assert bridge_main(["env", "tasks", "http://127.0.0.1:1"]) == 2  # nothing listens there
    assert capsys.readouterr().err.startswith("jaxrl env tasks: environment 'http://127.0.0.1:1': reading the task "
                                              "splits of http://127.0.0.1:1 failed: ConnectError")

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    serve = ["serve", "--model", str(tmp_path)]
    (tmp_path / "shared-token").write_text("a-token")
    (tmp_path / "shared-token").chmod(0o644)
    for args, message in [
        ([], "jaxrl bridge: error: the bridge needs a token: pass --token-file FILE (a new token is written there "
             f"if FILE does not exist) or set {TOKEN_ENV}"),
        (["--token-file", str(tmp_path / "no-such-dir" / "token")], "cannot write a new token to"),
        (["--token-file", str(tmp_path / "shared-token")], f"the bridge token file {tmp_path / 'shared-token'} is "
                                                           "readable by every user"),
        (["--max-group-size", "0"], "jaxrl bridge: error: --max-group-size must be at least 1, got 0"),
        (["--lora", str(tmp_path / "no-adapter_config.json")], "jaxrl bridge: error: --lora "),
    ]:
        assert bridge_main(serve + args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    monkeypatch.setenv(TOKEN_ENV, "a-token")
    for args, message in [
        (["--tls-cert", str(tmp_path / "cert.pem")], "jaxrl bridge: error: TLS needs both --tls-cert and --tls-key"),
        (["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")], "cannot read"),
        (["--host", "0.0.0.0"], "jaxrl bridge: error: --host 0.0.0.0 listens beyond loopback, where the token would "
                                "travel in clear text: give --tls-cert and --tls-key, or pass --insecure"),
    ]:
        assert bridge_main(serve + args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_a_launch_file_is_the_whole_launch_and_a_bad_one_is_a_one_line_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "a-token")
    launch = tmp_path / "launch.json"
    for text, args, message in [
        (None, [], f"jaxrl bridge: error: cannot read {launch}: No such file or directory"),
        ('{"model": "m", "gpus": 2}', [], "jaxrl bridge: error: not a bridge launch ("),
        ('{"model": "m"}', ["--port", "1", "--max-groups", "2"], "jaxrl bridge: error: --launch FILE holds the whole "
                                                                 "launch; give no other serve flags with it (--port, "
                                                                 "--max-groups)"),
        ('{"model": "m", "engine": "tensorrt"}', [], "unknown engine 'tensorrt'"),
        (f'{{"model": "{tmp_path}", "server": {{"host": "0.0.0.0"}}}}', [], "--host 0.0.0.0 listens beyond loopback"),
    ]:
        if text is not None:
            launch.write_text(text)
        assert bridge_main(["serve", "--launch", str(launch), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_jaxrl_bridge_hands_its_arguments_to_python_m_bridge(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxrl.run.cli", "bridge", "--engine", "tensorrt", "--model",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert error_line(proc.stderr, "jaxrl bridge") == (
        "jaxrl bridge: error: unknown engine 'tensorrt'; choose one of: jax, vllm")


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key: (cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_a_tls_bridge_serves_its_token_holders_only(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", "qwen3")
    cert, key = _self_signed(tmp_path, "bridge")
    stranger, _ = _self_signed(tmp_path, "stranger")
    token_file = tmp_path / "token"
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
    proc = subprocess.Popen([sys.executable, "-m", "bridge", "serve", "--model", str(model_dir), "--token-file",
                             str(token_file), "--tls-cert", str(cert), "--tls-key", str(key)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith(BRIDGE_LISTENING), proc.communicate(timeout=10)[1][-3000:]
        address = line[len(BRIDGE_LISTENING):].strip()
        # The token file did not exist: the bridge wrote a fresh token there, for its owner's eyes only.
        token = token_file.read_text().strip()
        assert len(token) >= 32 and stat.S_IMODE(token_file.stat().st_mode) == 0o600

        with BridgeClient(address, timeout_s=10, token=token, tls_ca=cert) as client:
            assert client.health().status == "serving"
            assert len(list(client.rollout([[1, 2]], 2, SamplingParams(max_tokens=2)))) == 2
        for wrong in (None, token[:-1]):
            with BridgeClient(address, timeout_s=10, token=wrong, tls_ca=cert) as intruder:
                for call in (lambda: list(intruder.rollout([[1]], 1, SamplingParams(max_tokens=2))),
                             lambda: intruder.load_snapshot(tmp_path, 999), intruder.health, intruder.stats,
                             intruder.shutdown):
                    with pytest.raises(BridgeUnauthenticated) as e:
                        call()
                    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        # Without the certificate: no connection, and errors that say why.
        for tls_ca, hint in ((None, "if the bridge serves TLS, give its certificate authority (tls_ca=, "
                                    "bridge.tls_ca)"),
                             (stranger, f"TLS: the bridge's certificate is not one {stranger} vouches for")):
            with BridgeClient(address, timeout_s=5, token=token, tls_ca=tls_ca) as outsider:
                with pytest.raises(BridgeUnavailable, match="unavailable during Health") as e:
                    outsider.health()
                assert hint in str(e.value)

        with BridgeClient(address, timeout_s=10, token=token, tls_ca=cert) as client:
            assert client.stats()["unauthenticated"] == 10
            client.shutdown()
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert f"wrote a new token to {token_file}" in err and token not in err
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
