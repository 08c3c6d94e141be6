"""Tuner: search space, intra-stage Pareto frontiers, inter-stage partition DP, baselines."""
from .api import TuneResult, tune
from .baselines import BASELINE_SPACES, tune_baseline
from .space import SearchSpace, TuneError

__all__ = ["BASELINE_SPACES", "SearchSpace", "TuneError", "TuneResult", "tune", "tune_baseline"]
