"""The WiM algorithm: segmentation, prompts, relevance, events and orchestration.

This package is engine-agnostic: it imports neither vLLM nor Ray nor any HTTP library. Engines
plug in through the protocols in `wim_service.wim.backend`.
"""
