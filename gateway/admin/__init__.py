"""The admin listener's front end: the operator API, its protocol, the CLI's client."""
