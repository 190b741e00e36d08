"""Recovery policy and state restore (coordinator, StateHook, step replay, event log).

Built by the rank-level recovery work; nothing is exported yet.
"""

__all__: list[str] = []
