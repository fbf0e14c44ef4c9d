"""pp_runtime: pipeline-parallel LLM inference with SARATHI-style scheduling."""
from pp_runtime.config import Config, ConfigError, load_config
from pp_runtime.core.request import FinishReason, InvalidRequestError, RequestOutput, SamplingParams

__all__ = ["LLM", "Config", "ConfigError", "FinishReason", "InvalidRequestError",
           "RequestOutput", "SamplingParams", "load_config"]


def __getattr__(name):  # LLM imports torch: load it only when asked for
    if name == "LLM":
        from pp_runtime.engine.llm import LLM

        return LLM
    raise AttributeError(name)
