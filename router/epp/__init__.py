"""kvrouter as a Gateway API Inference Extension endpoint picker (EPP): an Envoy ext_proc server
that decides with the router's own decision code (docs/gateway.md). Needs ``kvrouter[epp]``
(grpcio, grpcio-health-checking, and Envoy's generated protos from xds-protos)."""
