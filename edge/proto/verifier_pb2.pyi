from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("vocab_size", "max_draft", "max_context", "session_ttl_s", "model_id", "adapter_id", "tokenizer_id")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    max_draft: int
    max_context: int
    session_ttl_s: float
    model_id: str
    adapter_id: str
    tokenizer_id: str
    def __init__(self, vocab_size: _Optional[int] = ..., max_draft: _Optional[int] = ..., max_context: _Optional[int] = ..., session_ttl_s: _Optional[float] = ..., model_id: _Optional[str] = ..., adapter_id: _Optional[str] = ..., tokenizer_id: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("prompt_ids", "sampling")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session_id", "vocab_size", "max_draft", "max_context", "session_ttl_s", "model_id", "adapter_id", "tokenizer_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    vocab_size: int
    max_draft: int
    max_context: int
    session_ttl_s: float
    model_id: str
    adapter_id: str
    tokenizer_id: str
    def __init__(self, session_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_draft: _Optional[int] = ..., max_context: _Optional[int] = ..., session_ttl_s: _Optional[float] = ..., model_id: _Optional[str] = ..., adapter_id: _Optional[str] = ..., tokenizer_id: _Optional[str] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "draft_ids", "draft_probs", "draft_dists", "expected_length", "committed_ids", "sampling", "version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[float]
    draft_dists: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    expected_length: int
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    version: str
    def __init__(self, session_id: _Optional[str] = ..., draft_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[float]] = ..., draft_dists: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ..., expected_length: _Optional[int] = ..., committed_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., version: _Optional[str] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("accepted", "next_token", "session_length", "opened")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    session_length: int
    opened: SessionInfo
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., session_length: _Optional[int] = ..., opened: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("session_length",)
    SESSION_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_length: int
    def __init__(self, session_length: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_ids", "max_new_tokens", "sampling", "stop_token_id", "batch_tokens")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: Sampling
    stop_token_id: int
    batch_tokens: bool
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., stop_token_id: _Optional[int] = ..., batch_tokens: _Optional[bool] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("token_id", "more_token_ids")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    more_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_id: _Optional[int] = ..., more_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
