"""The engine: claim, forward, classify, settle; what a caller gets back."""
