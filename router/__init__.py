"""The global prefix index in Redis and the routing policies that read it, with the Ray Serve router that runs them."""
