"""The router: Generation service, draft pool client, target discovery, the round loop."""
