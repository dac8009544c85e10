"""Where instances come from: the embedded local provider (worker processes on this host), AWS EC2, a Ray cluster."""
