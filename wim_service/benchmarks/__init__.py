"""`wim bench`: the engine benchmark (`engine`) and the service benchmark (`service`, an HTTP
client of a local Ray Serve app), with what they share in `common`."""
