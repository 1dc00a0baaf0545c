"""Torch building blocks of the models: RMSNorm, rotary embeddings, activations, MoE."""
