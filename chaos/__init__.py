"""Fault injection: netns testbed, injectors, TOML scenarios and the ``resilient chaos`` CLI.

Built by the chaos work; nothing is exported yet.
"""

__all__: list[str] = []
