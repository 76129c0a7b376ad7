"""Calibration: measure an engine's costs on the real engine and fit the `EngineProfile` that
placement and `wim sim` read (`wim calibrate`).

One engine is started with the given config, warmed up, and timed on:

* plain requests of random token ids (`probe.py`): prefills of `new` tokens after `cached`
  ones, and decode steps of batches over a shared context;
* WiM queries on a document session (`queries.py`): what they take beyond those two costs
  is `query_extra_tokens`;
* restores of a saved document (`restores.py`, a temporary KV store): the restore cost.

`fit.py` fits the profile's costs to these samples (the typed `EngineProfile.samples`) and
reports how well they match (`describe`); `run.py` runs it all. How well the fits match on
the development machine, and under what load: docs/routing.md ("wim sim", the calibration).
"""
