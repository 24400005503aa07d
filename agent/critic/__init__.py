"""Critics: ``grounded`` (deterministic, from stored evidence) and ``llm`` (a model's analysis, number-checked).

Importing this package registers both with ``agent.critic.base``.
"""
from agent.critic import grounded, llm  # noqa: F401  (register "grounded" and "llm")
