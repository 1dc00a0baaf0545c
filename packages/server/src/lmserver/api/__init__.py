"""HTTP API: FastAPI app with the SGLang-native and OpenAI-compatible routes."""

from lmserver.api.app import create_app

__all__ = ["create_app"]
