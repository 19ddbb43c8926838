from services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TruncationSide(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_SIDE_UNSPECIFIED: _ClassVar[TruncationSide]
    TRUNCATION_SIDE_LEFT: _ClassVar[TruncationSide]
    TRUNCATION_SIDE_RIGHT: _ClassVar[TruncationSide]
TRUNCATION_SIDE_UNSPECIFIED: TruncationSide
TRUNCATION_SIDE_LEFT: TruncationSide
TRUNCATION_SIDE_RIGHT: TruncationSide

class TokenizeRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "add_special_tokens", "add_generation_prompt", "truncation_side", "max_tokens", "trace_context", "tools_json")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_SIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: _common_pb2.Conversation
    add_special_tokens: bool
    add_generation_prompt: bool
    truncation_side: TruncationSide
    max_tokens: int
    trace_context: _containers.ScalarMap[str, str]
    tools_json: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.Conversation, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., truncation_side: _Optional[_Union[TruncationSide, str]] = ..., max_tokens: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("request_id", "ids", "truncated", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    truncated: bool
    error: str
    def __init__(self, request_id: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ..., truncated: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecialToken(_message.Message):
    __slots__ = ("name", "text", "id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    text: str
    id: int
    def __init__(self, name: _Optional[str] = ..., text: _Optional[str] = ..., id: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "context_length", "special_tokens", "eos_token_ids", "has_chat_template", "chat_template", "generation_prompt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    context_length: int
    special_tokens: _containers.RepeatedCompositeFieldContainer[SpecialToken]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    chat_template: str
    generation_prompt: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., special_tokens: _Optional[_Iterable[_Union[SpecialToken, _Mapping]]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., chat_template: _Optional[str] = ..., generation_prompt: _Optional[str] = ...) -> None: ...
