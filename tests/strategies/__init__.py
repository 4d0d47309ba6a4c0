"""Tests of burncoll.strategies: a symbolic simulator plays every schedule."""
