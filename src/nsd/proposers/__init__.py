"""Proposers: one small interface (:class:`Proposer`), one file per mechanism."""

from nsd.proposers.base import Proposal, Proposer

__all__ = ["Proposal", "Proposer"]
