"""Test fakes: `MockBackend` (in-process) and local fake HTTP servers for the two HTTP backends."""

from lmdsl.testing.mock import MockBackend, MockCall, mock_tokens

__all__ = ["MockBackend", "MockCall", "mock_tokens"]
