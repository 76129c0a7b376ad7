"""The OpenAI-compatible API (`/v1`) over a `WiMRouter`."""
