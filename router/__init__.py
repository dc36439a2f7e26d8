"""kvrouter router: the OpenAI-compatible front door, policy, proxy, tokenization and observability."""
