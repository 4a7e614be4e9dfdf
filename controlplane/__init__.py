"""Control plane: registry, tenants, API keys, rollouts."""
