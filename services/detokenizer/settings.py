"""Settings of the detokenizer service (flags `--model`, ... and `SLUICE_*` variables)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.settings import StageTlsSettings


@dataclass(frozen=True)
class DetokenizerSettings(StageTlsSettings):
    """sluice detokenizer service: streams of token ids in, streams of text deltas out."""

    model: str = field(
        default="", metadata={"help": "local Hugging Face model directory; empty = the embedded tiny model"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50053, metadata={"help": "gRPC port (0 = any free port)"})
    grace_s: float = field(default=5.0, metadata={"help": "seconds calls in flight get to finish on SIGTERM"})
    workers: int = field(default=1, metadata={"help": "processes sharing the port (SO_REUSEPORT)"})
    metrics_port: int = field(
        default=0,
        metadata={
            "help": "Prometheus /metrics HTTP port (0 = none); worker i of --workers serves on this port + i"
        },
    )
    max_batch_size: int = field(
        default=64,
        metadata={"help": "most messages (across calls) decoded in one batch on the worker thread"},
    )
    read_ahead: int = field(
        default=16,
        metadata={
            "help": "messages read ahead on a call while earlier ones are decoded (processed together)"
        },
    )
    remember_finished: int = field(
        default=65536,
        metadata={"help": "finished request ids remembered per call, whose late chunks are ignored"},
    )

    def validate(self) -> None:
        """Raises ValueError naming the first bad value."""
        self.validate_tls()
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
