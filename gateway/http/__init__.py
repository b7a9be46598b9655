"""The caller-side HTTP/1.1 listener: one protocol, the request cycle, the request read."""
