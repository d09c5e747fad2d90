"""reasoning-gym's procedural tasks as a WHALE domain family (`domain.name: reasoning_gym`)."""

from whale.domains.reasoning_gym.domain import ReasoningGymDomain

__all__ = ["ReasoningGymDomain"]
