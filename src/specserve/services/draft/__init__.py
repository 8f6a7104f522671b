"""The draft worker: a gRPC server around one drafter and a bounded LRU of sessions."""
