"""Fault injection: netns testbed, injectors, TOML scenarios and the ``resilient chaos`` CLI.

So far: scenario files (:mod:`chaos.scenario`). The testbed, the injectors and the
CLI come with the rest of the chaos work.
"""

from chaos.scenario import (
    FAULT_KINDS,
    Expectations,
    Fault,
    JobSpec,
    Scenario,
    ScenarioError,
    load,
    parse,
)

__all__ = [
    "FAULT_KINDS",
    "Expectations",
    "Fault",
    "JobSpec",
    "Scenario",
    "ScenarioError",
    "load",
    "parse",
]
