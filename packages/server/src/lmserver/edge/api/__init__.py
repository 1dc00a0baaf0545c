"""HTTP API: FastAPI app with the SGLang-native and OpenAI-compatible routes."""

from lmserver.edge.api.app import create_app

__all__ = ["create_app"]
