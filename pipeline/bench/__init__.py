"""`pipeline bench`: does speculation pay on this machine? Sweeps concurrency with speculation off, always
on and gated, and fits where it stops paying (docs/gate.md)."""
