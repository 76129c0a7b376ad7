"""wim_service: Writing-in-the-Margins long-document QA on vLLM engines behind Ray Serve."""

__version__ = "0.1.0"
