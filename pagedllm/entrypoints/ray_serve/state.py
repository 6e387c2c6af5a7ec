"""What the front and its router share in the front's process. Both reach it as `state.NAME`: Serve ships the
router and the front's class by value (copies of the globals they name), while this module is imported by name."""

from __future__ import annotations

import threading
from typing import Any


class FailedReplicas:
    """Replicas the front saw fail (their engine dead): avoided at once, before Serve's health check replaces
    them. Shared by the front's handlers and the router, which runs on Serve's router thread."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, replica: str) -> None:
        with self._lock:
            self._ids.add(replica)

    def keep_only(self, live: set[str]) -> None:
        with self._lock:
            self._ids &= live

    def __contains__(self, replica: str) -> bool:
        with self._lock:
            return replica in self._ids


FAILED = FailedReplicas()
# The routers of this process by deployment name (`PrefixAwareRouter`s): the front lists the replicas through them.
ROUTERS: dict[str, Any] = {}
