from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_INT8: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
DTYPE_UNSPECIFIED: Dtype
DTYPE_INT8: Dtype
DTYPE_INT32: Dtype
DTYPE_INT64: Dtype

class Position(_message.Message):
    __slots__ = ("epoch", "step")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("job", "rank", "world_size", "start", "prefetch", "schedule_fingerprint", "client_id", "elastic", "resume", "own_cursor")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    OWN_CURSOR_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    start: Position
    prefetch: int
    schedule_fingerprint: str
    client_id: str
    elastic: bool
    resume: Resume
    own_cursor: bool
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., start: _Optional[_Union[Position, _Mapping]] = ..., prefetch: _Optional[int] = ..., schedule_fingerprint: _Optional[str] = ..., client_id: _Optional[str] = ..., elastic: _Optional[bool] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., own_cursor: _Optional[bool] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("generation", "incarnation")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    incarnation: str
    def __init__(self, generation: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("through", "credit")
    THROUGH_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    through: Position
    credit: int
    def __init__(self, through: _Optional[_Union[Position, _Mapping]] = ..., credit: _Optional[int] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("n",)
    N_FIELD_NUMBER: _ClassVar[int]
    n: int
    def __init__(self, n: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("open", "ack", "credit")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    open: Open
    ack: Ack
    credit: Credit
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ...) -> None: ...

class EpochEnd(_message.Message):
    __slots__ = ("epoch", "steps")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    steps: int
    def __init__(self, epoch: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class Buffer(_message.Message):
    __slots__ = ("dtype", "offset", "length")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    offset: int
    length: int
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class BatchHeader(_message.Message):
    __slots__ = ("epoch", "step", "rank", "bucket", "rows", "padded_len", "real_tokens", "padded_tokens", "schedule_fingerprint", "payload_bytes", "input_ids", "loss_mask", "lengths", "sample_ids")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PADDED_LEN_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    rank: int
    bucket: int
    rows: int
    padded_len: int
    real_tokens: int
    padded_tokens: int
    schedule_fingerprint: str
    payload_bytes: int
    input_ids: Buffer
    loss_mask: Buffer
    lengths: Buffer
    sample_ids: Buffer
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., bucket: _Optional[int] = ..., rows: _Optional[int] = ..., padded_len: _Optional[int] = ..., real_tokens: _Optional[int] = ..., padded_tokens: _Optional[int] = ..., schedule_fingerprint: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., input_ids: _Optional[_Union[Buffer, _Mapping]] = ..., loss_mask: _Optional[_Union[Buffer, _Mapping]] = ..., lengths: _Optional[_Union[Buffer, _Mapping]] = ..., sample_ids: _Optional[_Union[Buffer, _Mapping]] = ...) -> None: ...

class FrameHeader(_message.Message):
    __slots__ = ("version", "batch", "epoch_end", "start")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_END_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    version: int
    batch: BatchHeader
    epoch_end: EpochEnd
    start: StreamStart
    def __init__(self, version: _Optional[int] = ..., batch: _Optional[_Union[BatchHeader, _Mapping]] = ..., epoch_end: _Optional[_Union[EpochEnd, _Mapping]] = ..., start: _Optional[_Union[StreamStart, _Mapping]] = ...) -> None: ...

class StreamStart(_message.Message):
    __slots__ = ("generation", "incarnation", "position", "schedule_fingerprint", "world_size")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    incarnation: str
    position: Position
    schedule_fingerprint: str
    world_size: int
    def __init__(self, generation: _Optional[int] = ..., incarnation: _Optional[str] = ..., position: _Optional[_Union[Position, _Mapping]] = ..., schedule_fingerprint: _Optional[str] = ..., world_size: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("epoch", "step", "rank", "bucket", "rows", "padded_len", "real_tokens", "padded_tokens", "schedule_fingerprint", "input_ids_dtype", "loss_mask_dtype", "lengths_dtype", "sample_ids_dtype", "input_ids", "loss_mask", "lengths", "sample_ids")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PADDED_LEN_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    rank: int
    bucket: int
    rows: int
    padded_len: int
    real_tokens: int
    padded_tokens: int
    schedule_fingerprint: str
    input_ids_dtype: Dtype
    loss_mask_dtype: Dtype
    lengths_dtype: Dtype
    sample_ids_dtype: Dtype
    input_ids: bytes
    loss_mask: bytes
    lengths: bytes
    sample_ids: bytes
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., bucket: _Optional[int] = ..., rows: _Optional[int] = ..., padded_len: _Optional[int] = ..., real_tokens: _Optional[int] = ..., padded_tokens: _Optional[int] = ..., schedule_fingerprint: _Optional[str] = ..., input_ids_dtype: _Optional[_Union[Dtype, str]] = ..., loss_mask_dtype: _Optional[_Union[Dtype, str]] = ..., lengths_dtype: _Optional[_Union[Dtype, str]] = ..., sample_ids_dtype: _Optional[_Union[Dtype, str]] = ..., input_ids: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., lengths: _Optional[bytes] = ..., sample_ids: _Optional[bytes] = ...) -> None: ...

class BatchFrame(_message.Message):
    __slots__ = ("batch", "epoch_end")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_END_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    epoch_end: EpochEnd
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., epoch_end: _Optional[_Union[EpochEnd, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("job", "world_size", "epoch", "rank", "own_cursor")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OWN_CURSOR_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    epoch: int
    rank: int
    own_cursor: bool
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., own_cursor: _Optional[bool] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job", "world_size", "epoch", "steps_per_epoch", "schedule_fingerprint", "config_fingerprint", "dataset_fingerprint", "bucket_bounds", "token_budget", "max_batch_size", "max_frame_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DATASET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    world_size: int
    epoch: int
    steps_per_epoch: int
    schedule_fingerprint: str
    config_fingerprint: str
    dataset_fingerprint: str
    bucket_bounds: _containers.RepeatedScalarFieldContainer[int]
    token_budget: int
    max_batch_size: int
    max_frame_bytes: int
    def __init__(self, job: _Optional[str] = ..., world_size: _Optional[int] = ..., epoch: _Optional[int] = ..., steps_per_epoch: _Optional[int] = ..., schedule_fingerprint: _Optional[str] = ..., config_fingerprint: _Optional[str] = ..., dataset_fingerprint: _Optional[str] = ..., bucket_bounds: _Optional[_Iterable[int]] = ..., token_budget: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "reason", "message", "field", "cursor")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    field: str
    cursor: Position
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., cursor: _Optional[_Union[Position, _Mapping]] = ...) -> None: ...
