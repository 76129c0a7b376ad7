"""The serving layer: Ray Serve deployments and the HTTP API (owns Ray and HTTP)."""
