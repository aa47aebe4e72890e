"""rollout: a continuous-batching RL rollout engine for Hugging Face causal LMs."""

from .batch import RolloutBatch
from .config import ContinuousBatchingConfig
from .engine import RolloutEngine
from .factories import continuous_batching_context_manager, init_continuous_batching
from .generate import generate_batch
from .manager import ContinuousBatchingManager
from .requests import GenerationOutput, RequestStatus
from .score_batch import ScoreBatch

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "GenerationOutput",
    "RequestStatus",
    "RolloutBatch",
    "RolloutEngine",
    "ScoreBatch",
    "continuous_batching_context_manager",
    "generate_batch",
    "init_continuous_batching",
]
