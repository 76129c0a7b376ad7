"""The engine layer: owns vLLM (and the transformers reference backend).

`VLLMBackend` (`vllm_engine`) runs WiM contexts (`vllm_context`) and plain requests on one
`AsyncLLM`, each request made as `request_params` says; `scheduler.WiMScheduler` adds
per-session purge and KV statistics inside the engine core; `first_token.FirstTokenChoice`
forces a margin's first token to YES/NO; `admission.KVAdmission` keeps parked sessions from
over-committing the KV cache; `hf_backend.HFBackend` is the plain-transformers oracle.
"""
