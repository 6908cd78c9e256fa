"""Replays and micro-benchmarks of the scheduler and cache with the null runner (`k3rt bench ...`)."""
