"""Speculative decoding: drafters propose tokens (base.py), one target forward verifies them
(rejection.py), and the KDA layers replay only the accepted prefix into the live state."""
