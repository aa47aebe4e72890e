"""Sticky sessions: every request of a session (vLLM's and SGLang routers' `X-Session-ID`: one agent episode, one
multi-turn conversation) goes to the member (a server URL in `RolloutPool`, an engine index in `RolloutFleet`) that
took its first one, where its earlier turns' KV is cached. A session's member is forgotten when the caller finishes
it (`finish`, the pools' `finish_session`, vLLM's `POST /finish_session?session_id=`), when the member dies
(`forget`), or when the table is full (least recently used first, at most `max_sessions`). Requests without a session
route as before (prefix-aware or least loaded).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence

DEFAULT_MAX_SESSIONS = 1 << 16


class SessionTable:
    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.members: OrderedDict[str, Hashable] = OrderedDict()

    def get(self, session: str, alive: Collection) -> Hashable | None:
        """The member holding `session` if it is still in `alive`, else None (and the session is dropped)."""
        member = self.members.get(session)
        if member is None:
            return None
        if member not in alive:
            del self.members[session]
            return None
        self.members.move_to_end(session)
        return member

    def stick(self, session: str, member: Hashable) -> None:
        self.members[session] = member
        self.members.move_to_end(session)
        while len(self.members) > self.max_sessions:
            self.members.popitem(last=False)

    def finish(self, session: str) -> Hashable | None:
        """Forget `session`; returns the member that held it (None if unknown)."""
        return self.members.pop(session, None)

    def forget(self, member: Hashable) -> None:
        """Drop every session on `member` (dead): their next requests route afresh."""
        for s in [s for s, m in self.members.items() if m == member]:
            del self.members[s]


def check_session_ids(session_ids: Sequence[str | None] | None, count: int) -> list[str | None]:
    """One session id (a non-empty string, or None for none) per prompt; ValueError naming `session_ids`."""
    if session_ids is None:
        return [None] * count
    if isinstance(session_ids, str) or len(session_ids) != count:
        raise ValueError(f"session_ids must hold one session id (or None) for each of the {count} prompts, "
                         f"got {session_ids!r}")
    for s in session_ids:
        if s is not None and (not isinstance(s, str) or not s):
            raise ValueError(f"session_ids must be non-empty strings or None, got {s!r}")
    return list(session_ids)


def place_sessions(session_ids: Sequence[str | None], table: SessionTable, load: Mapping[Hashable, int],
                   serving: Sequence[Hashable]) -> list[Hashable]:
    """The member of each item: its session's member when that one is serving, else the least loaded (counting
    this call's items placed so far), which the session then sticks to."""
    load = {m: load[m] for m in serving}
    out = []
    for session in session_ids:
        member = table.get(session, serving) if session is not None else None
        if member is None:
            member = min(serving, key=lambda m: load[m])
            if session is not None:
                table.stick(session, member)
        load[member] += 1
        out.append(member)
    return out
