"""shm_engine: a vLLM-style LLM engine for x86 CPUs over shared-memory rings and int8 kernels."""

from shm_engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput"]


def __getattr__(name: str):
    # NOTE: lazy, so `import shm_engine` (e.g. in the engine process or the IPC benchmark) does not
    # pull in torch and the model stack.
    if name == "LLM":
        from shm_engine.entrypoints.llm import LLM

        return LLM
    if name == "RequestOutput":
        from shm_engine.engine.output_processor import RequestOutput

        return RequestOutput
    raise AttributeError(name)
