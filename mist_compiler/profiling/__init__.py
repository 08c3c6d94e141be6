"""Measuring hardware: ``mistc profile``'s compute, copy and collective timers and fits
(:mod:`.profiler`, :mod:`.timing`, :mod:`.comm`) and the live-memory probe the cost model is
checked against (:mod:`.live_memory`). May import ``cost`` (the profile schema) and ``runtime``.
"""
