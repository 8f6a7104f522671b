"""Builds specserve's own small draft/target pair offline (DESIGN §7)."""
