"""The Mist IR: captured programs, blocks and symbolic shapes; the plan schema; (de)serialisation."""
from .plan import Offload, Plan, PlanError, StagePlan, load_plan, save_plan

__all__ = ["Offload", "Plan", "PlanError", "StagePlan", "load_plan", "save_plan"]
