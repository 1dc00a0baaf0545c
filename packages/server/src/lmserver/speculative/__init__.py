"""Speculative decoding: draft sources (n-gram prompt lookup) and the exact acceptance rules."""
