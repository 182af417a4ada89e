"""Engines kvmesh did not start: their spec and driver, Serve's proxies, the mixed deployment, kvmesh router."""
