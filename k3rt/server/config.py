"""`ServerConfig`: everything `k3rt serve` is started with, parsed once by the CLI. No torch."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from k3rt.config import EngineConfig


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 30000
    # when set, /v1/* (and /metrics, unless metrics_public) require "Authorization: Bearer <one of them>",
    # and the DSL port a client holding one of them
    api_keys: tuple[str, ...] = ()
    # "api-key": each key's requests (HTTP and DSL) share cached prefixes only with that key's; "none": one
    # cache for everyone. None: "api-key" when keys are set
    cache_isolation: str | None = None
    metrics_public: bool = False  # with keys set, /metrics needs no key
    served_model_name: str | None = None  # None: the model folder's name
    context_length: int | None = None  # None: the model's max_position_embeddings
    drain_timeout_s: float = 10.0  # on SIGTERM/SIGINT, how long running requests may finish before abort
    max_body_bytes: int = 32 << 20  # request bodies above this are answered 413
    log_level: str = "WARNING"
    dsl_addr: str | None = "auto"  # ZMQ endpoint for shipped DSL programs; "auto": tcp://host:port+1; None: off
    dsl_max_message_bytes: int = 16 << 20  # ZMQ_MAXMSGSIZE of the DSL port: a larger frame drops its connection
    stall_timeout_s: float = 30.0  # /health answers 503 when the engine has work and no progress this long; 0: off

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length: must be >= 1, got {self.context_length}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        if not self.stall_timeout_s >= 0:
            raise ValueError(f"stall_timeout_s: must be >= 0 (0 disables), got {self.stall_timeout_s}")
        if self.dsl_addr not in (None, "auto") and not self.dsl_addr.startswith(("tcp://", "ipc://")):
            raise ValueError(f"dsl_addr: {self.dsl_addr!r} must be 'auto', or start with tcp:// or ipc://")
        if self.dsl_max_message_bytes < 1:
            raise ValueError(f"dsl_max_message_bytes: must be >= 1, got {self.dsl_max_message_bytes}")
        if any(not k for k in self.api_keys):
            raise ValueError("api_key: must not be empty")
        if self.cache_isolation is None:
            object.__setattr__(self, "cache_isolation", "api-key" if self.api_keys else "none")
        if self.cache_isolation not in ("none", "api-key"):
            raise ValueError(f"cache_isolation: {self.cache_isolation!r} not one of none, api-key")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {self.max_body_bytes}")

    def tenant(self, key: str) -> str | None:
        """The prefix-cache namespace of a request made with `key` (None: shared). A digest, so neither
        logs nor the cache ever hold the key itself."""
        if self.cache_isolation != "api-key":
            return None
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]

    def resolved_dsl_addr(self, http_port: int) -> str | None:
        if self.dsl_addr != "auto":
            return self.dsl_addr
        return f"tcp://{self.host}:{http_port + 1}" if self.port else f"tcp://{self.host}:*"

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).resolve().name
