"""Drafters propose K tokens and their q; they learn from the outcome (DESIGN §2)."""

from specserve.drafters.base import Drafter, DraftProposal, DraftSession
from specserve.drafters.hf import HFDrafter
from specserve.drafters.ngram import NgramDrafter

__all__ = ["DraftProposal", "DraftSession", "Drafter", "HFDrafter", "NgramDrafter"]
