"""SGLang-compatible frontend language for LM programs: gen, select, fork/join, roles, tracing, API speculative execution.

Existing SGLang programs run by changing only the import: `import lmdsl as sgl`.
"""

from lmdsl.api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    greedy_token_selection,
    image,
    select,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)
from lmdsl.backend.base import Backend
from lmdsl.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from lmdsl.config import LmdslConfig
from lmdsl.errors import (
    BackendError,
    ChatTemplateError,
    ConstraintNotSupportedError,
    LmdslError,
    NoBackendError,
    ProgramError,
    SpeculationError,
    TraceError,
)
from lmdsl.function import (
    Function,
    flush_cache,
    function,
    get_default_backend,
    get_server_info,
    global_config,
    set_default_backend,
    use_backend,
)
from lmdsl.interpreter import Usage
from lmdsl.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, SamplingParams
from lmdsl.state import ProgramState, ProgramStateGroup

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # NOTE: the HTTP backends import httpx (and openai) only when first used.
    if name == "RuntimeEndpoint":
        from lmdsl.backend.runtime_endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    if name == "OpenAI":
        from lmdsl.backend.openai_backend import OpenAI

        return OpenAI
    if name in ("Runtime", "Engine"):
        raise AttributeError(
            f"lmdsl.{name} (a model in this process) lives in the server package, which lmdsl does not import: "
            "`from lmserver.edge.lmdsl_backend import Runtime` (then lmdsl.set_default_backend(Runtime())), or start "
            "`lmserver serve` and use lmdsl.RuntimeEndpoint(url)")
    raise AttributeError(f"module 'lmdsl' has no attribute {name!r}")


__all__ = [
    "Backend", "BackendError", "ChatTemplate", "ChatTemplateError", "ConstraintNotSupportedError",
    "Function", "LmdslConfig", "LmdslError", "NoBackendError", "OpenAI", "ProgramError", "ProgramState",
    "ProgramStateGroup", "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "RuntimeEndpoint",
    "SamplingParams", "SpeculationError", "TraceError", "Usage", "__version__", "assistant",
    "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_chat_template", "get_chat_template_by_model_path", "get_default_backend", "get_server_info",
    "global_config", "greedy_token_selection", "image", "select", "set_default_backend", "system",
    "system_begin", "system_end", "token_length_normalized", "unconditional_likelihood_normalized",
    "use_backend", "user", "user_begin", "user_end", "video",
]
