"""verifiers environments (the Prime Intellect environment format) as a WHALE domain."""

from whale.domains.verifiers_env.domain import VerifiersDomain

__all__ = ["VerifiersDomain"]
