"""Settings of the tokenizer service (flags `--model`, ... and `SLUICE_*` variables)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.settings import TextStageSettings


@dataclass(frozen=True)
class TokenizerSettings(TextStageSettings):
    """sluice tokenizer service: text or chat messages in, token ids out."""

    port: int = field(default=50051, metadata={"help": "gRPC port (0 = any free port)"})
    max_batch_size: int = field(default=256, metadata={"help": "most requests tokenized in one encode_batch"})
