"""Cost model: hardware profiles, op-time model, collectives and copies, overlap, memory, stage costs.
May import ``ir``, ``ops``, ``models``, ``passes`` and ``frontend``."""
