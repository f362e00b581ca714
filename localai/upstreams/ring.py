"""The routing of a remote model's requests: the requests of one session (its id, else its first messages) go to
the same replica, picked on a consistent-hash ring, so that replica's prefix cache keeps serving it and adding a
replica moves few sessions."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from localai.models.registry import ModelRecord
from localai.schema import GenerationRequest

VNODES = 64  # points per replica on the ring: sessions spread within a few percent of even


def _point(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class HashRing:
    """Consistent hashing: each replica owns ``VNODES`` points; a key belongs to the next point clockwise."""

    def __init__(self, nodes: Sequence[str], vnodes: int = VNODES) -> None:
        points = sorted((_point(f"{node}#{index}"), node) for node in nodes for index in range(vnodes))
        self._keys = [point for point, _ in points]
        self._nodes = [node for _, node in points]
        self._count = len(set(nodes))

    def preference(self, key: str) -> list[str]:
        """Every node, in the order ``key`` should try them: its owner first, then the next ones on the ring."""
        if not self._nodes:
            return []
        order: list[str] = []
        start = bisect.bisect(self._keys, _point(key))
        for offset in range(len(self._nodes)):
            node = self._nodes[(start + offset) % len(self._nodes)]
            if node not in order:
                order.append(node)
                if len(order) == self._count:
                    break
        return order


def routing_key(record: ModelRecord, request: GenerationRequest) -> str:
    """The session a request belongs to: its id, else its first messages (or the prompt's start)."""
    if request.session_id:
        partition = f"{request.cache_partition}\0" if request.cache_partition else ""
        return f"session\0{partition}{request.session_id}"
    digest = hashlib.sha256(record.name.encode() + request.cache_partition.encode())
    if request.messages is not None:
        for message in request.messages[:2]:
            digest.update(message.role.encode() + b"\0" + message.text()[:4096].encode() + b"\0")
    else:
        digest.update((request.prompt or "")[:4096].encode())
    return digest.hexdigest()

