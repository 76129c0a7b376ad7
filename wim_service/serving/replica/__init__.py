"""The engine replica: its deployment, its remote protocol and the router's client of it."""
