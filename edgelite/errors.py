"""Every failure a caller can act on, one class each."""

from __future__ import annotations


class EdgeliteError(Exception):
    """Base class: a user-facing error whose message says what was wrong."""


class ManifestError(EdgeliteError):
    """manifest.json is missing, of an unknown format, or does not match its files."""


class ModelFileError(EdgeliteError):
    """A model file is missing, truncated, or its sha256 differs from the manifest."""


class UnsupportedModel(EdgeliteError):
    """The source model's architecture or options are not supported by the exporter."""


class SourceNotFound(EdgeliteError):
    """The exporter's SOURCE is not a folder, a GGUF file, a known alias or a reachable hub id."""


class VerificationFailed(EdgeliteError):
    """The exported ONNX chain does not reproduce the source model."""

    def __init__(self, message: str, layer: int | None = None) -> None:
        super().__init__(message)
        self.layer = layer


class MissingDependency(EdgeliteError):
    """An optional package is needed for this command; the message names what to install."""


class ProtocolError(EdgeliteError):
    """A peer sent a frame that breaks the wire protocol (size, type, tensor layout)."""


class StreamError(ProtocolError):
    """The framing itself broke (a length over the limit, a frame cut short or too slow): the
    connection cannot be followed any further and is closed."""


class AuthError(EdgeliteError):
    """Handshake failed: wrong cluster token, protocol version or model fingerprint."""


class NodeError(EdgeliteError):
    """A stage node replied with an error, or could not be reached in time."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class NodeUnavailable(NodeError):
    """A node died, stalled past its timeout, or refused the connection."""


class PlanInfeasible(EdgeliteError):
    """No placement fits the devices' memory; the message says how much is short."""


class KVBudgetExceeded(EdgeliteError):
    """A session's KV cache would exceed the node's memory budget."""


class QueueFull(EdgeliteError):
    """A user has as many requests queued or running as it may; try again later."""
