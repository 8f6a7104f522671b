"""specserve services: each talks to the others only over the wire (DESIGN §1)."""
