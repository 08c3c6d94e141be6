"""Tuner: search space, intra-stage Pareto frontiers, inter-stage partition DP, baselines. May import
``ir`` and ``cost`` (it searches over the cost model's prices; it never captures)."""
from .api import TuneResult, tune
from .baselines import BASELINE_SPACES, tune_baseline
from .space import SearchSpace, TuneError

__all__ = ["BASELINE_SPACES", "SearchSpace", "TuneError", "TuneResult", "tune", "tune_baseline"]
