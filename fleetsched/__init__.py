"""fleetsched: run fleets of tool-using LLM agents from many tenants on shared inference."""

__version__ = "0.1.0"
