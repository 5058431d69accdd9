"""``torchrun --rdzv-backend antdt``: torchrun's c10d rendezvous with the job's blacklist checked before a node joins.

Why: an evicted node that is started again (a scheduler retrying it, an operator by mistake) would otherwise join the
c10d rendezvous like any spare. Its arrival makes every running agent stop its workers for a new round (they
checkpoint first, see `AntDTAgent`), and only then does the Agent learn from the service that the round holds a
blacklisted node and re-form once more without it: two re-formations of the whole job for nothing, every time the
node is retried. This backend asks the shard service before each rendezvous round whether this node is blacklisted,
and if so leaves before joining: the agent logs why and exits with code 0 (not a failure a scheduler should retry),
and the running job never notices. A refused gate does not pass on torchrun's closing ``shutdown()``: on c10d that
would close the rendezvous of the running job for good.

Use it in place of ``c10d`` with the same endpoint and options, plus the service address when the agents do not
have ``ANTDT_SERVICE_URL`` in their environment::

    torchrun --nnodes 1:4 --rdzv-backend antdt --rdzv-endpoint host:29400 --rdzv-id job \\
        --rdzv-conf antdt_url=http://host:8470 train.py

It is registered through the ``torchrun.handlers`` entry point of this package. The node's name is `node_id`
(``$ANTDT_NODE_ID``, else the host name), the one its workers report. When the service cannot be reached the node
joins (the Agent checks the blacklist again when the round forms), so an outage of the service never blocks a job.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create_dynamic_handler
from transformers.utils import logging

from .client import ShardingClient
from .config import AgentConfig
from .elastic import node_id
from .errors import AntDTError

__all__ = ["BACKEND", "BlacklistGate", "create_handler", "handler_creator"]

logger = logging.get_logger(__name__)

BACKEND = "antdt"


def blacklist_reason(client: ShardingClient, node: str) -> str | None:
    """Why ``node`` may not join this job (None: it may), as the service's status says."""
    entry = client.status().get("blacklist", {}).get(node)
    if entry is None:
        return None
    return str(entry.get("reason", "evicted")) if isinstance(entry, dict) else str(entry)


class BlacklistGate(RendezvousHandler):
    """A c10d rendezvous handler that refuses to start a round on a blacklisted node; otherwise it is the c10d
    handler (every other call is delegated unchanged)."""

    def __init__(self, inner: RendezvousHandler, client: ShardingClient | None, node: str):
        self._inner = inner
        self._client = client
        self._node = node
        self.refused: str | None = None  # why this node did not join (then it never touches the rendezvous)

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        self.check()
        return self._inner.next_rendezvous()

    def check(self) -> None:
        """End the agent before it joins (``SystemExit(0)``) when this node is blacklisted.

        Not torch's `RendezvousGracefulExitError`: with it the agent's ``run()`` returns nothing and torchrun's
        launcher fails on the missing result (torch 2.13), exiting 1 with a traceback."""
        if self._client is None:
            return
        try:
            reason = blacklist_reason(self._client, self._node)
        except (AntDTError, OSError) as e:
            logger.warning("antdt rendezvous: could not read the blacklist from %s (%s); node %s joins, and its "
                           "workers check again when the round forms", self._client.url, e, self._node)
            return
        if reason is not None:
            logger.error("antdt rendezvous: node %s is blacklisted by the job's shard service (%s); it does not join "
                         "the rendezvous. Start a different node, or clear the blacklist in a new job.", self._node,
                         reason)
            self.refused = reason
            raise SystemExit(0)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        if self.refused is not None:
            return False  # never joined: closing would end the running job's rendezvous
        return self._inner.shutdown()


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``antdt`` backend: a c10d handler behind the blacklist gate. Options (``--rdzv-conf``): those of c10d,
    plus ``antdt_url`` (default ``$ANTDT_SERVICE_URL``; without either, the gate is off and says so)."""
    url = params.config.pop("antdt_url", None) or os.environ.get("ANTDT_SERVICE_URL")
    backend, store = create_backend(params)
    inner = create_dynamic_handler(store, backend, params)
    client = None
    if url:
        # a short retry budget: a service that is down must not hold the node's agent for the Agent's full minute
        client = ShardingClient(url, config=AgentConfig(url=url, request_timeout_s=5.0, retry_timeout_s=10.0))
    else:
        logger.warning("antdt rendezvous: no service address (--rdzv-conf antdt_url=... or $ANTDT_SERVICE_URL); the "
                       "blacklist is not checked before joining")
    return BlacklistGate(inner, client, node_id())


def handler_creator():
    """What the ``torchrun.handlers`` entry point loads: torchrun registers the returned creator under ``antdt``."""
    return create_handler
