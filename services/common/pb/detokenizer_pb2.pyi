from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DetokenizeStart(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "skip_special_tokens", "stop", "include_stop_str_in_output", "trace_context", "keep_special_ids")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    trace_context: _containers.ScalarMap[str, str]
    keep_special_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., keep_special_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeChunk(_message.Message):
    __slots__ = ("request_id", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeClose(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class DetokenizeInEntry(_message.Message):
    __slots__ = ("start", "chunk", "close")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    start: DetokenizeStart
    chunk: DetokenizeChunk
    close: DetokenizeClose
    def __init__(self, start: _Optional[_Union[DetokenizeStart, _Mapping]] = ..., chunk: _Optional[_Union[DetokenizeChunk, _Mapping]] = ..., close: _Optional[_Union[DetokenizeClose, _Mapping]] = ...) -> None: ...

class DetokenizeIn(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[DetokenizeInEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[DetokenizeInEntry, _Mapping]]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("request_id", "text", "num_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    num_ids: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., num_ids: _Optional[int] = ...) -> None: ...

class DetokenizeFinal(_message.Message):
    __slots__ = ("request_id", "stopped", "stop", "num_ids_consumed", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_IDS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stopped: bool
    stop: str
    num_ids_consumed: int
    error: str
    def __init__(self, request_id: _Optional[str] = ..., stopped: _Optional[bool] = ..., stop: _Optional[str] = ..., num_ids_consumed: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class DetokenizeOutEntry(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: TextDelta
    final: DetokenizeFinal
    def __init__(self, delta: _Optional[_Union[TextDelta, _Mapping]] = ..., final: _Optional[_Union[DetokenizeFinal, _Mapping]] = ...) -> None: ...

class DetokenizeOut(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[DetokenizeOutEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[DetokenizeOutEntry, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("ids", "skip_special_tokens")
    IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenPiecesRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenPiece(_message.Message):
    __slots__ = ("text", "bytes")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    text: str
    bytes: bytes
    def __init__(self, text: _Optional[str] = ..., bytes: _Optional[bytes] = ...) -> None: ...

class TokenPiecesResponse(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[TokenPiece]
    def __init__(self, pieces: _Optional[_Iterable[_Union[TokenPiece, _Mapping]]] = ...) -> None: ...
