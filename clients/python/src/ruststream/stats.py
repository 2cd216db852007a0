"""The worker's counters (``Worker.stats``): what it received, how each message ended, and
what went wrong on the way."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerStats:
    """Counters since the worker started; read them at any time (no lock needed: the worker
    updates them on its event loop only)."""

    #: leases received from the gateway
    received: int = 0
    #: settles the gateway confirmed, by outcome
    acked: int = 0
    naked: int = 0
    termed: int = 0
    #: leases extended (``in-progress`` confirmed)
    extended: int = 0
    #: buffered messages dropped unstarted because their lease had expired
    expired_in_buffer: int = 0
    #: messages whose handler outlived ``max_lease``: no longer extended (logged once each)
    lease_given_up: int = 0
    #: handler exceptions other than Nak/Term (each nak'd with backoff)
    handler_errors: int = 0
    #: settles or extensions that did not succeed, by HTTP status (0: no answer in time)
    settle_failures: dict[int, int] = field(default_factory=dict)
    #: connections opened again after one was lost or ended by the gateway
    reconnects: int = 0

    def failure(self, status: int) -> None:
        self.settle_failures[status] = self.settle_failures.get(status, 0) + 1
