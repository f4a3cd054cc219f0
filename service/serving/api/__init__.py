"""The protocols: the FastAPI app and its routes (/v1, OIP v2 REST, KServe V1, the credit page), the OIP gRPC service,
their shared codec and rules, schemas, keys, middleware, error shapes and uvicorn's HTTP/1.1 handling guarded. Thin:
every route translates an envelope and calls the pipeline through the app's state."""
