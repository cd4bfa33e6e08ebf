"""kserve: a small, exact inference server for Kimi K2."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from kserve.engine.llm import LLM
    from kserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import kserve.chat` does not pull in the engine and torch.
    if name == "LLM":
        from kserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
