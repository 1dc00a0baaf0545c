"""The process edge: the `lmserver` command, process launch, the HTTP APIs, the tokenizer
manager, the data-parallel router, IPC with the engine-core process, metrics.

Processes, sockets and the event loop live here; nothing here runs model code
(the core process builds its engine from a factory name, `core_loop`)."""
