"""Where instances come from: the embedded local provider (worker processes on this host) and AWS EC2."""
