"""The trainer's side of the bridge: a synchronous gRPC client with typed errors.

`rollout` is an iterator that yields each trajectory as the bridge streams it. Failures are
typed: `BridgeUnavailable` when the bridge is gone, unreachable or past its deadline (a killed
bridge is noticed at once through its closed connection, a silent one through keepalive pings
within `timeout_s`), `BridgeRequestError` (with the gRPC code and message) when the bridge
refused a request (`BridgeUnauthenticated` when it refused the token), `BridgeProtocolError`
when a reply cannot be decoded.

Every call carries `token` (the bridge's: its `--token-file` or $JAXRL_BRIDGE_TOKEN). With
`tls_ca` (a PEM file of the certificate authority, or of the bridge's self-signed certificate)
the connection is TLS and the bridge must present a certificate it vouches for, under the host
name or IP of `address`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np

from bridge import wire
from bridge.engines.base import SamplingParams
from bridge.proto import bridge_pb2 as pb
from bridge.proto import bridge_pb2_grpc as pb_grpc
from bridge.wire import PROTOCOL_VERSION, PromptGroup, TrajectoryData

_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class BridgeError(RuntimeError):
    """Base of the errors a BridgeClient raises."""


class BridgeUnavailable(BridgeError):
    """The bridge process is gone, unreachable, or did not answer within the deadline."""

    def __init__(self, address: str, what: str, code: grpc.StatusCode | None = None, details: str = "",
                 hint: str = ""):
        self.address, self.code, self.details = address, code, details
        why = f"{code.name}: {details}" if code is not None else details
        super().__init__(f"bridge at {address} unavailable during {what} ({why})" + (f"; {hint}" if hint else ""))


class BridgeRequestError(BridgeError):
    """The bridge refused a request; `code` is the gRPC status code, `details` its message."""

    def __init__(self, address: str, what: str, code: grpc.StatusCode, details: str):
        self.address, self.code, self.details = address, code, details
        super().__init__(f"bridge at {address} refused {what}: {code.name}: {details}")


class BridgeUnauthenticated(BridgeRequestError):
    """The bridge refused the call's token: none was sent, or not the bridge's own."""

    def __init__(self, address: str, what: str, details: str, sent: bool):
        self.address, self.code, self.details = address, grpc.StatusCode.UNAUTHENTICATED, details
        problem = "is not the bridge's" if sent else "was not given (BridgeClient token=)"
        BridgeError.__init__(self, (
            f"bridge at {address} refused {what}: the token {problem}; a bridge's token is its --token-file or "
            f"${wire.TOKEN_ENV}, and `jaxrl train` reads it from bridge.token_file or ${wire.TOKEN_ENV}"))


class BridgeProtocolError(BridgeError):
    """A reply that cannot be decoded (another protocol version, bad byte lengths)."""


@dataclasses.dataclass(frozen=True)
class Health:
    status: str
    engine: str
    policy_version: int


@dataclasses.dataclass(frozen=True)
class SnapshotLoaded:
    version: int
    load_s: float


class BridgeClient:
    """A connection to one bridge at `address` ("host:port") whose token is `token`.

    `timeout_s` is the deadline of every unary call and the bound on noticing a dead bridge while
    a rollout streams. A rollout itself has no deadline unless given one (generation can be long).
    `tls_ca`: connect over TLS, trusting the certificates in this PEM file.
    """

    def __init__(self, address: str, timeout_s: float = 60.0, token: str | None = None,
                 tls_ca: str | Path | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.tls_ca = tls_ca
        self._metadata = ((wire.AUTH_METADATA, wire.BEARER + token),) if token else ()
        self._answered = False  # whether the bridge ever answered: a failure before that may be TLS
        self._closed = False
        ping_ms = max(int(timeout_s * 1000) // 2, 1000)
        options = [
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", ping_ms),
            ("grpc.keepalive_timeout_ms", ping_ms),
            ("grpc.http2.ping_timeout_ms", ping_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if tls_ca is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            try:
                ca = Path(tls_ca).read_bytes()
            except OSError as e:
                raise BridgeError(f"cannot read the bridge's TLS certificate authority {tls_ca}: {e.strerror}") from None
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options)
        self._stub = pb_grpc.BridgeStub(self._channel)

    # -- errors ---------------------------------------------------------------------------------

    def _error(self, e: grpc.RpcError, what: str) -> BridgeError:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return BridgeUnauthenticated(self.address, what, details, sent=bool(self._metadata))
        if code in _UNAVAILABLE:
            return BridgeUnavailable(self.address, what, code, details, self._tls_hint(details))
        return BridgeRequestError(self.address, what, code, details)

    def _tls_hint(self, details: str) -> str:
        """What a failure to connect says about TLS: gRPC's own words are about sockets and handshakes."""
        if self.tls_ca is not None and "handshake failed" in details.lower():
            return (f"TLS: the bridge's certificate is not one {self.tls_ca} vouches for (for this host name), "
                    "or the bridge does not serve TLS")
        if self.tls_ca is None and not self._answered and "socket closed" in details.lower():
            return "if the bridge serves TLS, give its certificate authority (tls_ca=, bridge.tls_ca)"
        return ""

    def _closed_error(self, e: ValueError, what: str) -> Exception:
        """gRPC's ValueError for a call on a closed channel: the bridge is unavailable to this client
        (closed by another thread, e.g. one that found the bridge dead); any other ValueError as it is."""
        return BridgeUnavailable(self.address, what, details="the client was closed") if self._closed else e

    def _call(self, method, request, what: str, timeout_s: float | None = None):
        try:
            reply = method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, what) from None
        except ValueError as e:
            raise self._closed_error(e, what) from None
        self._answered = True
        try:
            wire.check_version(reply, f"{what} reply")
        except wire.WireError as e:
            raise BridgeProtocolError(str(e)) from None
        return reply

    # -- calls ----------------------------------------------------------------------------------

    def rollout(
        self,
        groups: Iterable[PromptGroup | Sequence[int] | np.ndarray],
        group_size: int,
        sampling: SamplingParams,
        min_policy_version: int = 0,
        timeout_s: float | None = None,
        policy: str = "",
    ) -> Iterator[TrajectoryData]:
        """Yields the len(groups) x group_size trajectories in the order their episodes finish.

        `sampling.n` is ignored: `group_size` is the number of samples per prompt. Plain token id
        sequences are groups "0", "1", ... Closing the iterator early cancels the rest on the bridge.
        `policy="solver"` has each environment's own solver play instead of the model.
        """
        request = wire.rollout_request(groups, group_size, sampling, min_policy_version, policy)
        expected = len(request.groups) * group_size
        return self._stream(request, expected, timeout_s)

    def _stream(self, request: pb.RolloutRequest, expected: int, timeout_s: float | None):
        try:
            call = self._stub.Rollout(request, timeout=timeout_s, metadata=self._metadata)
        except ValueError as e:
            raise self._closed_error(e, "rollout") from None
        received = 0
        try:
            for msg in call:
                try:
                    traj = wire.trajectory_from_proto(msg)
                except wire.WireError as e:
                    raise BridgeProtocolError(str(e)) from None
                received += 1
                self._answered = True
                yield traj
        except grpc.RpcError as e:
            raise self._error(e, f"rollout (after {received} of {expected} trajectories)") from None
        finally:
            call.cancel()  # a no-op once the stream is complete; cancels the episodes otherwise
        if received != expected:
            raise BridgeProtocolError(f"rollout stream ended after {received} of {expected} trajectories")

    def load_snapshot(self, path: str, version: int, timeout_s: float | None = None) -> SnapshotLoaded:
        """Has the bridge serve snapshot `version` from the snapshots directory `path`."""
        request = pb.LoadSnapshotRequest(protocol_version=PROTOCOL_VERSION, path=str(path), version=version)
        reply = self._call(self._stub.LoadSnapshot, request, f"LoadSnapshot({path}, {version})", timeout_s)
        return SnapshotLoaded(reply.version, reply.load_s)

    def health(self, timeout_s: float | None = None) -> Health:
        reply = self._call(self._stub.Health, pb.HealthRequest(protocol_version=PROTOCOL_VERSION),
                           "Health", timeout_s)
        return Health(reply.status, reply.engine, reply.policy_version)

    def stats(self, timeout_s: float | None = None) -> dict[str, float]:
        reply = self._call(self._stub.Stats, pb.StatsRequest(protocol_version=PROTOCOL_VERSION),
                           "Stats", timeout_s)
        return dict(reply.counters)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Asks the bridge to stop (it finishes within its grace period)."""
        self._call(self._stub.Shutdown, pb.ShutdownRequest(protocol_version=PROTOCOL_VERSION),
                   "Shutdown", timeout_s)

    def close(self) -> None:
        """Closes the connection; calls under way (in any thread) end with BridgeUnavailable."""
        self._closed = True
        self._channel.close()

    def __enter__(self) -> BridgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
