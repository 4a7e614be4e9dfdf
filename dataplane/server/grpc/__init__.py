"""gRPC for service-to-service traffic: the same requests as the HTTP API, over the same DataPlane facade."""
