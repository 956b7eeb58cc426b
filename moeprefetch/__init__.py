"""moeprefetch: run DeepSeek-class MoE models larger than GPU memory on one GPU, with expert prefetching."""

from .engine import GenerationResult, MoEPrefetchEngine, TokenEvent
from .errors import CheckpointError, MoEPrefetchError, RequestError, ResourceError
from .options import EngineConfig

__all__ = [
    "MoEPrefetchEngine",
    "EngineConfig",
    "GenerationResult",
    "TokenEvent",
    "MoEPrefetchError",
    "CheckpointError",
    "RequestError",
    "ResourceError",
]
__version__ = "0.1.0"
