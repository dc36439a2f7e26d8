"""Flow control: saturation, a bounded admission queue with priority bands and per-flow fairness,
and late binding (docs/flow-control.md)."""
