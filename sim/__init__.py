"""kvrouter sim: a simulated vLLM fleet (mock engines), workloads, trace replay and the demo."""
