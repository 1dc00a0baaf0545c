"""The runner: a scheduler decision to tensors to a forward to sampled tokens.

Model runner, CUDA graphs, sampler, attention backends and their registry, draft
proposers and acceptance rules, tensor-parallel ranks, lowlat dispatch, and the
resolution of "auto" config values it needs."""
