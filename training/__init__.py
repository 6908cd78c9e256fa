"""The default model's (k3-tiny's) training: its corpus (`corpus`), training helpers on k3rt's own
KimiForCausalLM (`train`), unlikelihood rounds against its greedy repetition loops (`unlikelihood`) and
evaluation by function completion through the Engine (`function_test`). scripts/ drives them.

This package may import `k3rt.backend`; serving code (`k3rt.backend`, `k3rt.server`) never imports it.
"""
