"""Tuner: search space, intra-stage Pareto frontiers, inter-stage MILP, baselines."""
