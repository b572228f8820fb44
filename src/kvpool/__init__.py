"""kvpool: does a shared KV-cache pool let vLLM replicas reuse each other's prefill, and at what cost."""

__version__ = "0.1.0"
