"""What the router shows about itself: Prometheus metrics and the dashboard's data."""
