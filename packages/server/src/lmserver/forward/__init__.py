"""The forward contract between the runner and the models: `ForwardBatch` (the tensors
of one forward), the attention interface (`AttentionBackend`, `AttentionLayer`) and
the KV pool they read and write."""
