"""Prefill/decode disaggregation: the ``[pd]`` settings (config), the KV connector protocols
(connector), the two-leg exchange (exchange) and its metrics (metrics). The two-pool decision is
:mod:`router.decision.pd`. See README.md in this directory."""
