"""kvinfer: a Python inference engine for decoder-only transformer LLMs."""
from kvinfer.sampling_params import SamplingParams, StructuredOutput

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutput", "EngineConfig", "__version__"]


def __getattr__(name):
    # Lazy, so `import kvinfer` (and `kvinfer --help`) does not pay for importing torch.
    if name == "LLM":
        from kvinfer.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvinfer.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from kvinfer.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
