from services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublicGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "chat", "sampling", "stopping", "return_token_ids", "skip_special_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    chat: _common_pb2.Conversation
    sampling: _common_pb2.SamplingParams
    stopping: _common_pb2.StoppingParams
    return_token_ids: bool
    skip_special_tokens: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.Conversation, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[_common_pb2.StoppingParams, _Mapping]] = ..., return_token_ids: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "stop")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    stop: str
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., stop: _Optional[str] = ...) -> None: ...

class PublicGenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: GenerateDelta
    final: GenerateFinal
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[GenerateDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...
