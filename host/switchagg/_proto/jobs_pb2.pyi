from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("secret", "job_name", "world_size", "ip", "udp_port", "rank", "timeout_s", "shards", "shard_ports", "shard_ips", "mtu")
    SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    UDP_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_PORTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_IPS_FIELD_NUMBER: _ClassVar[int]
    MTU_FIELD_NUMBER: _ClassVar[int]
    secret: str
    job_name: str
    world_size: int
    ip: str
    udp_port: int
    rank: int
    timeout_s: float
    shards: int
    shard_ports: _containers.RepeatedScalarFieldContainer[int]
    shard_ips: _containers.RepeatedScalarFieldContainer[str]
    mtu: int
    def __init__(self, secret: _Optional[str] = ..., job_name: _Optional[str] = ..., world_size: _Optional[int] = ..., ip: _Optional[str] = ..., udp_port: _Optional[int] = ..., rank: _Optional[int] = ..., timeout_s: _Optional[float] = ..., shards: _Optional[int] = ..., shard_ports: _Optional[_Iterable[int]] = ..., shard_ips: _Optional[_Iterable[str]] = ..., mtu: _Optional[int] = ...) -> None: ...

class ShardAssignment(_message.Message):
    __slots__ = ("index", "node", "aggregator_ip", "aggregator_port", "slot_base", "slot_count", "result_key", "udp_port")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_IP_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_PORT_FIELD_NUMBER: _ClassVar[int]
    SLOT_BASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    RESULT_KEY_FIELD_NUMBER: _ClassVar[int]
    UDP_PORT_FIELD_NUMBER: _ClassVar[int]
    index: int
    node: str
    aggregator_ip: str
    aggregator_port: int
    slot_base: int
    slot_count: int
    result_key: int
    udp_port: int
    def __init__(self, index: _Optional[int] = ..., node: _Optional[str] = ..., aggregator_ip: _Optional[str] = ..., aggregator_port: _Optional[int] = ..., slot_base: _Optional[int] = ..., slot_count: _Optional[int] = ..., result_key: _Optional[int] = ..., udp_port: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("data_plane", "aggregator_ip", "aggregator_port", "job_id", "rank", "world_size", "slot_base", "slot_count", "k", "generation", "result_key", "shards", "member_token")
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_IP_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_PORT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESULT_KEY_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    data_plane: str
    aggregator_ip: str
    aggregator_port: int
    job_id: int
    rank: int
    world_size: int
    slot_base: int
    slot_count: int
    k: int
    generation: int
    result_key: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardAssignment]
    member_token: str
    def __init__(self, data_plane: _Optional[str] = ..., aggregator_ip: _Optional[str] = ..., aggregator_port: _Optional[int] = ..., job_id: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., slot_base: _Optional[int] = ..., slot_count: _Optional[int] = ..., k: _Optional[int] = ..., generation: _Optional[int] = ..., result_key: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardAssignment, _Mapping]]] = ..., member_token: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("secret", "job_id", "rank", "member_token")
    SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    secret: str
    job_id: int
    rank: int
    member_token: str
    def __init__(self, secret: _Optional[str] = ..., job_id: _Optional[int] = ..., rank: _Optional[int] = ..., member_token: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("job_removed",)
    JOB_REMOVED_FIELD_NUMBER: _ClassVar[int]
    job_removed: bool
    def __init__(self, job_removed: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("secret", "job_id", "rank", "member_token")
    SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    secret: str
    job_id: int
    rank: int
    member_token: str
    def __init__(self, secret: _Optional[str] = ..., job_id: _Optional[int] = ..., rank: _Optional[int] = ..., member_token: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("admin_secret",)
    ADMIN_SECRET_FIELD_NUMBER: _ClassVar[int]
    admin_secret: str
    def __init__(self, admin_secret: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "ip", "udp_port", "left")
    RANK_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    UDP_PORT_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    ip: str
    udp_port: int
    left: bool
    def __init__(self, rank: _Optional[int] = ..., ip: _Optional[str] = ..., udp_port: _Optional[int] = ..., left: _Optional[bool] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "name", "data_plane", "world_size", "slot_base", "slot_count", "k", "generation", "workers", "state", "shards")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    name: str
    data_plane: str
    world_size: int
    slot_base: int
    slot_count: int
    k: int
    generation: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    state: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, job_id: _Optional[int] = ..., name: _Optional[str] = ..., data_plane: _Optional[str] = ..., world_size: _Optional[int] = ..., slot_base: _Optional[int] = ..., slot_count: _Optional[int] = ..., k: _Optional[int] = ..., generation: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., state: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("index", "node", "aggregator_ip", "aggregator_port", "slot_base", "slot_count")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_IP_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_PORT_FIELD_NUMBER: _ClassVar[int]
    SLOT_BASE_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    index: int
    node: str
    aggregator_ip: str
    aggregator_port: int
    slot_base: int
    slot_count: int
    def __init__(self, index: _Optional[int] = ..., node: _Optional[str] = ..., aggregator_ip: _Optional[str] = ..., aggregator_port: _Optional[int] = ..., slot_base: _Optional[int] = ..., slot_count: _Optional[int] = ...) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class TeardownRequest(_message.Message):
    __slots__ = ("admin_secret", "job")
    ADMIN_SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    admin_secret: str
    job: str
    def __init__(self, admin_secret: _Optional[str] = ..., job: _Optional[str] = ...) -> None: ...

class TeardownReply(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class CountersRequest(_message.Message):
    __slots__ = ("admin_secret",)
    ADMIN_SECRET_FIELD_NUMBER: _ClassVar[int]
    admin_secret: str
    def __init__(self, admin_secret: _Optional[str] = ...) -> None: ...

class Counter(_message.Message):
    __slots__ = ("data_plane", "scope", "name", "index", "packets", "bytes")
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PACKETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    data_plane: str
    scope: str
    name: str
    index: int
    packets: int
    bytes: int
    def __init__(self, data_plane: _Optional[str] = ..., scope: _Optional[str] = ..., name: _Optional[str] = ..., index: _Optional[int] = ..., packets: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Unavailable(_message.Message):
    __slots__ = ("data_plane", "error")
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    data_plane: str
    error: str
    def __init__(self, data_plane: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class CountersReply(_message.Message):
    __slots__ = ("counters", "unavailable")
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.RepeatedCompositeFieldContainer[Counter]
    unavailable: _containers.RepeatedCompositeFieldContainer[Unavailable]
    def __init__(self, counters: _Optional[_Iterable[_Union[Counter, _Mapping]]] = ..., unavailable: _Optional[_Iterable[_Union[Unavailable, _Mapping]]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("secret",)
    SECRET_FIELD_NUMBER: _ClassVar[int]
    secret: str
    def __init__(self, secret: _Optional[str] = ...) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("reducers",)
    REDUCERS_FIELD_NUMBER: _ClassVar[int]
    reducers: int
    def __init__(self, reducers: _Optional[int] = ...) -> None: ...
