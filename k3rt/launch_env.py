"""The launcher's environment (torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), read once at
startup into one typed object; the CLI turns it and the --tp/--nnodes/... flags into a DistConfig. No torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    rank: int | None = None  # RANK: this process's global rank (None: not started by a launcher)
    world_size: int | None = None  # WORLD_SIZE
    master_addr: str | None = None  # MASTER_ADDR
    master_port: int | None = None  # MASTER_PORT
    agent_store: bool = False  # TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent hosts the store

    @staticmethod
    def read(environ: Mapping[str, str] = os.environ) -> "LaunchEnv":
        def num(name: str) -> int | None:
            v = environ.get(name)
            if v is None:
                return None
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"{name}: must be an integer, got {v!r}") from None

        return LaunchEnv(num("RANK"), num("WORLD_SIZE"), environ.get("MASTER_ADDR"), num("MASTER_PORT"),
                         environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")

    @property
    def launched(self) -> bool:
        return self.rank is not None and self.world_size is not None
