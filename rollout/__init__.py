"""rollout: a continuous-batching RL rollout engine for Hugging Face causal LMs."""

from rollout.api.batch import RolloutBatch
from rollout.api.engine import RolloutEngine
from rollout.api.factories import continuous_batching_context_manager, init_continuous_batching
from rollout.api.generate import generate_batch
from rollout.api.score_batch import ScoreBatch
from rollout.config import ContinuousBatchingConfig
from rollout.contract import Rollout
from rollout.engine.manager import ContinuousBatchingManager
from rollout.requests import GenerationOutput, RequestStatus
from rollout.sampling_params import SamplingParams

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "GenerationOutput",
    "RequestStatus",
    "Rollout",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "ScoreBatch",
    "continuous_batching_context_manager",
    "generate_batch",
    "init_continuous_batching",
]
