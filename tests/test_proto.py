"""The committed gRPC stubs are what the committed .proto generates (run scripts/gen_proto.sh)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUBS = ("bridge/proto/bridge_pb2.py", "bridge/proto/bridge_pb2_grpc.py")


def test_committed_stubs_are_current(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
        str(ROOT / "bridge/proto/bridge.proto"),
    ])
    assert rc == 0, "protoc failed on bridge/proto/bridge.proto"
    for stub in STUBS:
        fresh = (tmp_path / stub).read_bytes()
        assert fresh == (ROOT / stub).read_bytes(), (
            f"{stub} is stale: regenerate the stubs with scripts/gen_proto.sh and commit them"
        )


def test_stubs_import_and_name_the_service():
    from bridge.proto import bridge_pb2, bridge_pb2_grpc

    service = bridge_pb2.DESCRIPTOR.services_by_name["Bridge"]
    assert {m.name for m in service.methods} == {"Rollout", "LoadSnapshot", "Health", "Stats", "Shutdown"}
    assert hasattr(bridge_pb2_grpc, "BridgeStub")
