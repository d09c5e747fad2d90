"""Proposers: whatever writes new candidate harnesses from the archive, and the one factory.

Three kinds share the small protocol in proposal.py:
- `AgentCLIProposer` (agent.py): a coding agent (Claude Code, Codex or any command) run under
  bubblewrap in a workspace outside the run directory. This is the paper's proposer.
- `ChatProposer` (chat.py): any OpenAI-compatible chat endpoint with our own file-tool loop, for
  setups without an agent CLI.
- `MutationProposer` (mutation.py): a fixed library of code transformations, offline and seeded.

A proposer failure (crash, timeout, nothing written, endpoint down) never stops the run: `propose`
returns [] and says why in `last_error`, and the loop records it.
"""

from __future__ import annotations

from whale.config import Config, ConfigError
from whale.harness.agent import AgentCLIProposer
from whale.harness.chat import ChatProposer
from whale.harness.mutation import MutationProposer
from whale.harness.proposal import Proposal, ProposalContext, Proposer, proposal_from_source


def make_proposer(cfg: Config) -> Proposer:
    """The proposer named by cfg.harness.proposer, with a clear error for missing or unused settings."""
    h = cfg.harness
    if h.proposer == "mutation":
        return MutationProposer(seed=cfg.seed, cfg=cfg)
    if h.proposer == "agent_cli":
        try:
            return AgentCLIProposer(h.agent_command, h.agent_timeout_s, tuple(h.agent_env), agent=h.agent,
                                    model=h.agent_model, sandbox=h.agent_sandbox, base_url=h.agent_base_url,
                                    binds=None if h.agent_binds is None else [(b.path, b.mode) for b in h.agent_binds])
        except (ValueError, RuntimeError) as e:  # a bad key, or a sandbox or CLI this machine lacks
            raise ConfigError(str(e)) from None
    if not (h.chat_model and h.chat_base_url):
        raise ConfigError("harness.proposer 'chat' needs harness.chat_model and harness.chat_base_url "
                          "(an OpenAI-compatible endpoint)")
    return ChatProposer(h.chat_model, h.chat_base_url, h.chat_api_key_env, max_turns=h.chat_max_turns,
                        retries=h.chat_retries, backoff_s=h.chat_backoff_s, history_turns=h.chat_history_turns,
                        history_tokens=h.chat_history_tokens)


__all__ = ["Proposal", "ProposalContext", "Proposer", "proposal_from_source", "AgentCLIProposer", "ChatProposer",
           "MutationProposer", "make_proposer"]
