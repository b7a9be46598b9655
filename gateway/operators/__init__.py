"""Operators: who they are, what each may do, what they do, and what they are shown."""
