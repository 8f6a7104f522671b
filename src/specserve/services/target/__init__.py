"""The target worker: the verifier behind a gRPC server, inside a Ray actor."""
