"""Continuous batching over the page pool and the radix prefix cache."""
