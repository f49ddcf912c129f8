"""Discrete-event simulation of a Tandem cluster over the router's real policy and index code."""
