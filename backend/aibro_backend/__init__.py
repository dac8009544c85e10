"""aibro training backend: REST + long-poll event service, scheduler, providers and the worker agent."""

__version__ = "0.1.0"
