"""modelfleet: convert, serve and route LLMs on a multi-tenant Kubernetes GPU fleet."""

__version__ = "0.1.0"
