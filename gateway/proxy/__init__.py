"""The proxy as callers meet it: the ASGI app, the status URL of an accepted request."""
