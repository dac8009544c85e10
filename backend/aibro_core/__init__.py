"""The small core shared by the notebook package, the backend and the worker agent: the event and state
vocabulary, the errors a user sees, the HTTP transport and private-file writing. It imports neither side, so
imports run one way (aibro_jupyter -> aibro_core <- aibro_backend) and the worker installs on a bare host."""
