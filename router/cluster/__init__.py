"""Router replicas that act as one: shared in-flight load, predictions and session pins (README,
"Router replicas"; this package's README.md for the design)."""
