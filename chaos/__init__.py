"""Fault injection: netns testbed, injectors, TOML scenarios and the ``resilient chaos`` CLI.

Scenario files (:mod:`chaos.scenario`), the testbeds (:mod:`chaos.testbed`), the
injectors (:mod:`chaos.injectors`), the runner and its report (:mod:`chaos.runner`,
:mod:`chaos.report`), the CLI (:mod:`chaos.cli`) and the removal of what runs leave
in the kernel (:mod:`chaos.cleanup`).
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
