"""Settings of the detokenizer service (flags `--model`, ... and `SLUICE_*` variables)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.settings import TextStageSettings


@dataclass(frozen=True)
class DetokenizerSettings(TextStageSettings):
    """sluice detokenizer service: streams of token ids in, streams of text deltas out."""

    port: int = field(default=50053, metadata={"help": "gRPC port (0 = any free port)"})
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
