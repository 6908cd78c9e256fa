"""DSpark drafting (issue 16 §1): a parallel block drafter on the target's hidden states.

model.py: the network (config, block layers, Markov head, confidence head, verify length).
checkpoint.py: the drafter's folder (config.json + safetensors) and its named errors.
target.py: reading the target's chosen layer states (what the drafter is conditioned on).
drafter.py: `DSparkDrafter`, the `Drafter` the scheduler calls.
"""
