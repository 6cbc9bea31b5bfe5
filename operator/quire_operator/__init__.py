"""The Quire operator: LLMDeployment resources become autoscaled `quire serve` pods (see handlers.py)."""
