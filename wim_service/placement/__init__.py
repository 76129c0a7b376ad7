"""Where work runs: one pure placement policy for the live router and for `wim sim`.

No Ray, no HTTP, no engine: the router describes its replicas as `ReplicaState`s and a job as
`Work`, asks a `PlacementPolicy`, and gets a `Placement` back; the simulator does the same over
simulated replicas, so a simulated policy is the code that serves.
"""
