"""rollout: a continuous-batching RL rollout engine for Hugging Face causal LMs."""

from .config import ContinuousBatchingConfig
from .generate import generate_batch
from .requests import GenerationOutput, RequestStatus

__all__ = ["ContinuousBatchingConfig", "GenerationOutput", "RequestStatus", "generate_batch"]
