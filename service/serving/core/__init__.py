"""Plain values every layer passes and raises (no torch, no HTTP, nothing of the layers above): the work a request
hands the engine, the results it gets back, the names heads and groups go by, the errors and the lifecycle."""
