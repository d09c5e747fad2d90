"""WHALE: joint harness-weight optimization for LLM agents.

Folders show the method: `engine/` serves the model, `harness/` runs harness files in sandboxes
(the one place a rollout happens), `domains/` holds tasks and verifiers, `weights/` is the weight
phase (online RSFT), `search/` the harness phase (Meta-Harness), `schedule.py` alternates them.
"""

__version__ = "0.1.0"
