"""Backends: the contract (`base`) and the built-in ones (runtime endpoint, OpenAI)."""

from lmdsl.backend.base import Backend, ChoiceDecision, GenResult, Prompt

__all__ = ["Backend", "ChoiceDecision", "GenResult", "Prompt"]
