"""Settings of the tokenizer service (flags `--model`, ... and `SLUICE_*` variables)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.settings import StageTlsSettings


@dataclass(frozen=True)
class TokenizerSettings(StageTlsSettings):
    """sluice tokenizer service: text or chat messages in, token ids out."""

    model: str = field(
        default="", metadata={"help": "local Hugging Face model directory; empty = the embedded tiny model"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=50051, metadata={"help": "gRPC port (0 = any free port)"})
    grace_s: float = field(default=5.0, metadata={"help": "seconds calls in flight get to finish on SIGTERM"})
    workers: int = field(default=1, metadata={"help": "processes sharing the port (SO_REUSEPORT)"})
    metrics_port: int = field(
        default=0,
        metadata={
            "help": "Prometheus /metrics HTTP port (0 = none); worker i of --workers serves on this port + i"
        },
    )
    max_batch_size: int = field(default=256, metadata={"help": "most requests tokenized in one encode_batch"})

    def validate(self) -> None:
        """Raises ValueError naming the first bad value."""
        self.validate_tls()
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
