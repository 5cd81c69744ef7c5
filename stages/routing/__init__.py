"""Which replica gets a request: the Serve request routers for the Engine and Egress hops."""
