"""The fleet: who the backends are (membership), their health and the load the router tracks."""
