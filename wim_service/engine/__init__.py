"""The engine layer: owns vLLM (and the transformers reference backend).

`VLLMBackend` runs WiM contexts on one `AsyncLLM`; `scheduler.WiMScheduler` adds per-session
purge and KV statistics inside the engine core; `first_token.FirstTokenChoice` forces a
margin's first token to YES/NO; `admission.KVAdmission` keeps parked sessions from
over-committing the KV cache; `hf_backend.HFBackend` is the plain-transformers oracle.
"""
