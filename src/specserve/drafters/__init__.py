"""Drafters propose K tokens and their q; they learn from the outcome (DESIGN §2)."""

from specserve.drafters.base import Drafter, DraftProposal, DraftSession
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.prediction import PredictionDrafter

__all__ = ["DraftProposal", "DraftSession", "Drafter", "HFDrafter", "NgramDrafter", "PredictionDrafter"]


def __getattr__(name: str):
    if name == "HFDrafter":  # imported on use: it needs torch, the router has none
        from specserve.drafters.hf import HFDrafter

        return HFDrafter
    raise AttributeError(name)
