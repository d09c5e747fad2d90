"""Search QA: retrieval-augmented factual QA (Search-R1 protocol), offline over the CIA World Factbook."""

from whale.domains.searchqa.domain import SearchQADomain, SearchQAEnv

__all__ = ["SearchQADomain", "SearchQAEnv"]
