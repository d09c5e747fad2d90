"""Tasks: search QA, math, chess, reasoning-gym tasks and verifiers environments, plus any user
domain named in the config.

`load_domain(cfg)` is the one entry point; `domain.module: "pkg.mod:Class"` loads your own class
(it must follow `whale.domains.base.Domain`; see examples/custom_domain.py). Only the chosen
domain's package is imported: together they load sympy, scipy, python-chess and asyncio (seconds),
and the command line imports this package at startup.
"""

from __future__ import annotations

import importlib

from whale.config import Config, ConfigError
from whale.domains.base import SPLITS, Domain, EpisodeEnv, EpisodeError, Problem

__all__ = ["SPLITS", "Domain", "EpisodeEnv", "EpisodeError", "Problem", "load_domain", "DOMAIN_NAMES"]

DOMAIN_NAMES = ("searchqa", "math", "chess", "reasoning_gym", "verifiers")


def load_domain(cfg: Config) -> Domain:
    if cfg.domain.module:
        return _user_domain(cfg)
    if cfg.domain.name == "searchqa":
        from whale.domains.searchqa import SearchQADomain  # lazy: only the chosen domain loads

        return SearchQADomain(cfg)
    if cfg.domain.name == "math":
        from whale.domains.math import MathDomain  # lazy: only the chosen domain loads

        return MathDomain(cfg)
    if cfg.domain.name == "chess":
        from whale.domains.chess import ChessDomain  # lazy: only the chosen domain loads

        return ChessDomain(cfg)
    if cfg.domain.name == "reasoning_gym":
        from whale.domains.reasoning_gym import ReasoningGymDomain  # lazy: only the chosen domain loads

        return ReasoningGymDomain(cfg)
    if cfg.domain.name == "verifiers":
        from whale.domains.verifiers_env import VerifiersDomain  # lazy: only the chosen domain loads

        return VerifiersDomain(cfg)
    raise ConfigError(f"unknown domain '{cfg.domain.name}': choose one of {', '.join(DOMAIN_NAMES)} "
                      "or set domain.module")


def _user_domain(cfg: Config) -> Domain:
    """The class `domain.module` names ('package.module:ClassName'), built from the config. It is
    the user's code, so its members are checked here, once, against the `Domain` protocol."""
    mod_name, _, cls_name = cfg.domain.module.partition(":")
    if not cls_name:
        raise ConfigError(f"domain.module must look like 'package.module:ClassName', got {cfg.domain.module!r}")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"domain.module {cfg.domain.module!r} could not be loaded: {e}") from None
    domain = cls(cfg)
    missing = [m for m in ("load_splits", "make_env", "grade", "grader", "base_harness")
               if not callable(getattr(domain, m, None))]
    missing += [m for m in ("answer_format", "hints") if not hasattr(domain, m)]
    if missing:
        raise ConfigError(f"domain {cfg.domain.name!r} lacks {', '.join(missing)} (see whale.domains.base.Domain; "
                          "a domain without a text answer or hints declares `answer_format = None`, "
                          "`hints = Hints()`)")
    return domain
