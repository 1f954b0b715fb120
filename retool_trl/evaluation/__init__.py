"""Evaluation with the interpreter: generation outside training with the trainer's rollout (`inference`), and
pass@1 / avg@k scored like the reward (`scoring`)."""

from .scoring import EvalReport, compute_metrics, evaluate, score_rollout, write_report

__all__ = ["EvalReport", "compute_metrics", "evaluate", "score_rollout", "write_report"]
