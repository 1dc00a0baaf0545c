"""Scheduler: a deterministic, torch-free object over queues, the radix cache and budgets."""
