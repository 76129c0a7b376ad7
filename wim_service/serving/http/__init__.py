"""The HTTP wire: bodies, the error table, API keys, edge limits, responses, page, PDF."""
