"""Pieces every Tandem process shares: block hashing, wire models, settings helpers.

Nothing in this package imports torch: the router depends on it and must stay small.
"""
