from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ("secret",)
    SECRET_FIELD_NUMBER: _ClassVar[int]
    secret: str
    def __init__(self, secret: _Optional[str] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("boot_id", "ip", "udp_port", "pool_slots")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    UDP_PORT_FIELD_NUMBER: _ClassVar[int]
    POOL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    ip: str
    udp_port: int
    pool_slots: int
    def __init__(self, boot_id: _Optional[str] = ..., ip: _Optional[str] = ..., udp_port: _Optional[int] = ..., pool_slots: _Optional[int] = ...) -> None: ...

class RankAddress(_message.Message):
    __slots__ = ("present", "ip", "udp_port")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    UDP_PORT_FIELD_NUMBER: _ClassVar[int]
    present: bool
    ip: str
    udp_port: int
    def __init__(self, present: _Optional[bool] = ..., ip: _Optional[str] = ..., udp_port: _Optional[int] = ...) -> None: ...

class AddJobRequest(_message.Message):
    __slots__ = ("secret", "job_id", "world_size", "slot_base", "slot_count", "k", "generation", "ranks", "name", "upstream_ip", "upstream_port", "leaf_index", "key", "no_loss_notices")
    SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_IP_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_PORT_FIELD_NUMBER: _ClassVar[int]
    LEAF_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NO_LOSS_NOTICES_FIELD_NUMBER: _ClassVar[int]
    secret: str
    job_id: int
    world_size: int
    slot_base: int
    slot_count: int
    k: int
    generation: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankAddress]
    name: str
    upstream_ip: str
    upstream_port: int
    leaf_index: int
    key: int
    no_loss_notices: bool
    def __init__(self, secret: _Optional[str] = ..., job_id: _Optional[int] = ..., world_size: _Optional[int] = ..., slot_base: _Optional[int] = ..., slot_count: _Optional[int] = ..., k: _Optional[int] = ..., generation: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankAddress, _Mapping]]] = ..., name: _Optional[str] = ..., upstream_ip: _Optional[str] = ..., upstream_port: _Optional[int] = ..., leaf_index: _Optional[int] = ..., key: _Optional[int] = ..., no_loss_notices: _Optional[bool] = ...) -> None: ...

class AddJobReply(_message.Message):
    __slots__ = ("replaced",)
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    replaced: bool
    def __init__(self, replaced: _Optional[bool] = ...) -> None: ...

class RemoveJobRequest(_message.Message):
    __slots__ = ("secret", "job_id")
    SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    secret: str
    job_id: int
    def __init__(self, secret: _Optional[str] = ..., job_id: _Optional[int] = ...) -> None: ...

class RemoveJobReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class AggListJobsRequest(_message.Message):
    __slots__ = ("secret",)
    SECRET_FIELD_NUMBER: _ClassVar[int]
    secret: str
    def __init__(self, secret: _Optional[str] = ...) -> None: ...

class InstalledJobInfo(_message.Message):
    __slots__ = ("job_id", "world_size", "slot_base", "slot_count", "k", "name", "key")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    world_size: int
    slot_base: int
    slot_count: int
    k: int
    name: str
    key: int
    def __init__(self, job_id: _Optional[int] = ..., world_size: _Optional[int] = ..., slot_base: _Optional[int] = ..., slot_count: _Optional[int] = ..., k: _Optional[int] = ..., name: _Optional[str] = ..., key: _Optional[int] = ...) -> None: ...

class AggListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[InstalledJobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[InstalledJobInfo, _Mapping]]] = ...) -> None: ...

class AggCountersRequest(_message.Message):
    __slots__ = ("secret",)
    SECRET_FIELD_NUMBER: _ClassVar[int]
    secret: str
    def __init__(self, secret: _Optional[str] = ...) -> None: ...

class AggCountersReply(_message.Message):
    __slots__ = ("counters_json",)
    COUNTERS_JSON_FIELD_NUMBER: _ClassVar[int]
    counters_json: str
    def __init__(self, counters_json: _Optional[str] = ...) -> None: ...
