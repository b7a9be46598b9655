"""Asynchronous delivery: the worker, one attempt, the retry schedule."""
