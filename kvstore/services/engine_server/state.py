"""ServerState: what every handler of one ``kvstore engine`` process shares, and the
``/v1/kvstore/info`` document built from it."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvstore.services.engine_server.auth import Auth
from kvstore.services.engine_server.loop import EngineLoop
from kvstore.services.engine_server.metrics import ServerMetrics
from kvstore.services.engine_server.tokenizer import ServeTokenizer


@dataclass
class ServerState:
    """Shared by the handlers (on the event loop thread); the server flips ``draining`` on SIGTERM."""

    loop: EngineLoop
    tokenizer: ServeTokenizer
    auth: Auth
    model_name: str
    kv_events: dict[str, Any]
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    num_inflight: int = 0
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.loop.load, self.loop.llm.kv_events)

    def info(self) -> dict[str, Any]:
        """Everything a router needs to compute this replica's keys and tokenize as it does."""
        llm = self.loop.llm
        ns = llm.namespace
        layout = ns.layout
        return {"model": self.model_name, "engine_id": self.engine_id, "block_size": layout.block_size,
                "namespace": {"model_id": ns.model_id, "num_layers": layout.num_layers,
                              "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                              "dtype": layout.dtype_name, "block_size": layout.block_size,
                              "tp_rank": layout.tp_rank, "tp_size": layout.tp_size, "hash_algo": ns.hash_algo,
                              # KV groups as KVLayout.groups holds them: [] is one full-attention group
                              "groups": [{"kind": g.kind, "layers": list(g.layers), "window": g.window}
                                         for g in layout.groups]},
                "tokenizer": self.tokenizer.info(), "kv_events": self.kv_events, "max_model_len": llm.max_model_len,
                "kv_cache_dtype": llm.kv_cache_dtype}
